"""Running one batch (the task "batches.run_batch"): validate, claim, feed the lines to the
deployment's replicas in their idle capacity, record durable progress, finalize.

- Validation reads every line before any token is spent (batches.lines); a bad file fails the batch.
- The claim is a conditional UPDATE that bumps `attempt`; a runner whose beat finds another attempt
  there stops. A batch whose heartbeat went stale (its worker died) is claimed again by the beat
  task `batches.tick`, and the new attempt resumes from the progress in storage.
- Progress: about every half second the lines finished since are written as one part file in the
  batch's storage folder, then the row's counts and heartbeat. On resume the part files say which
  `custom_id`s are done; only the others are sent. Each line's usage event has the request id
  `<batch id>-<hash of custom_id>`, so the ledger bills a line once even if it ran again (a line in
  flight when the worker died is sent again: its answer had not been recorded), and the output
  keeps one result per `custom_id`.
- Feeding: lines go to the ready replicas of the deployment's published route, at the lowest
  priority (the built-in engine runs them as background work, preempted by interactive requests).
  Each replica gets a window of lines in flight that grows while it has nothing waiting and halves
  when interactive requests queue (running + waiting beyond the batch's own lines); a degraded
  deployment gets no batch lines until it recovers.
- Cancel (status `cancelling`) and the end of the completion window stop new lines at once; the
  lines in flight get a short grace, then the batch ends with what finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import httpx
import redis.asyncio as aioredis
from django.conf import settings
from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from batches import services
from batches.choices import ENDPOINTS, BatchStatus
from batches.lines import parse_line
from batches.models import Batch
from deployments.choices import Backend
from runtime.gateway.contract import ROUTING_KEY, USAGE_STREAM

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.5
BATCH_PRIORITY = -1000  # the engine's background priority: below every interactive request
STOP_GRACE_S = 5.0
RETRY_DELAYS_S = (0.5, 1, 2, 4, 8, 15, 30)
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# What a runner may take up (again, when the one before it stopped beating).
RESUMABLE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
# A batch no runner has taken is enqueued again only after this many stale periods: it may simply
# wait its turn behind other batches on the batch worker.
NEVER_STARTED_FACTOR = 10


def request_id(batch_id: str, custom_id: str) -> str:
    """The line's usage event id: the same on every attempt, so the ledger bills it once (<= 64 chars)."""
    return f"{batch_id}-{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


@dataclass
class Line:
    number: int
    custom_id: str
    body: dict
    attempts: int = 0
    not_before: float = 0.0


@dataclass
class Outcome:
    """One finished line: its output (or error) record, and what it cost."""

    number: int
    custom_id: str
    ok: bool
    record: dict
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def part_line(self) -> dict:
        return {"line": self.number, "custom_id": self.custom_id, "ok": self.ok, "record": self.record,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


@dataclass
class Target:
    id: int
    url: str
    version: int
    backend: str
    window: int = 1
    inflight: int = 0
    failing_until: float = 0.0


# -- claim, progress -----------------------------------------------------------------------------


def claim(batch_id: str) -> int | None:
    """Take the batch for this runner: the attempt number, or None when another runner holds it."""
    stale = timezone.now() - timedelta(seconds=settings.INFEROPS_BATCH_STALE_S)
    with transaction.atomic():
        batch = Batch.objects.select_for_update().filter(pk=batch_id).first()
        if batch is None or batch.status not in RESUMABLE:
            return None
        if batch.heartbeat_at is not None and batch.heartbeat_at > stale:
            return None
        batch.attempt += 1
        batch.heartbeat_at = timezone.now()
        batch.save(update_fields=["attempt", "heartbeat_at"])
        return batch.attempt


def read_parts(batch: Batch) -> dict[str, dict]:
    """Every finished line in the batch's part files, by custom_id (the first record of each wins)."""
    storage = services.storage()
    done: dict[str, dict] = {}
    try:
        _, names = storage.listdir(batch.part_prefix)
    except FileNotFoundError:
        return done
    for name in sorted(names):
        for raw in services.read_lines(f"{batch.part_prefix}/{name}"):
            if raw.strip():
                part = json.loads(raw)
                done.setdefault(part["custom_id"], part)
    return done


class Progress:
    """What the feeder finished and the main thread has not saved yet (list appends are atomic)."""

    def __init__(self, batch: Batch, attempt: int, done: dict[str, dict]):
        self.batch = batch
        self.attempt = attempt
        self.outcomes: list[Outcome] = []
        self.saved = 0
        self.part = 0
        self.completed = sum(1 for part in done.values() if part["ok"])
        self.failed = len(done) - self.completed
        self.prompt_tokens = sum(part["prompt_tokens"] for part in done.values())
        self.completion_tokens = sum(part["completion_tokens"] for part in done.values())
        self.stop = threading.Event()
        self.lost = False  # another attempt took the batch over

    def flush(self) -> str:
        """Save what finished since the last flush, beat, and return the batch's status now."""
        new = self.outcomes[self.saved:len(self.outcomes)]
        if new:
            self.part += 1
            name = f"{self.batch.part_prefix}/{self.attempt:05d}-{self.part:06d}.jsonl"
            services.storage().save(name, ContentFile(services.jsonl(o.part_line() for o in new)))
            self.saved += len(new)
            for outcome in new:
                if outcome.ok:
                    self.completed += 1
                else:
                    self.failed += 1
                self.prompt_tokens += outcome.prompt_tokens
                self.completion_tokens += outcome.completion_tokens
        updated = Batch.objects.filter(pk=self.batch.pk, attempt=self.attempt).update(
            completed=self.completed, failed=self.failed, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, heartbeat_at=timezone.now())
        if not updated:
            self.lost = True
            self.stop.set()
            return "lost"
        status = Batch.objects.values_list("status", flat=True).get(pk=self.batch.pk)
        if status == BatchStatus.CANCELLING or timezone.now() >= self.batch.expires_at:
            self.stop.set()
        return status


# -- feeding the replicas ---------------------------------------------------------------------------


class Feeder:
    """Sends the pending lines to the route's replicas in their idle capacity (see the module's docstring)."""

    def __init__(self, batch: Batch, pending: list[Line], progress: Progress):
        self.batch = batch
        self.endpoint = ENDPOINTS[batch.endpoint]
        self.queue: deque[Line] = deque(pending)
        self.progress = progress
        self.targets: dict[int, Target] = {}
        self.paused_reason: str | None = None
        self.max_window = settings.INFEROPS_BATCH_MAX_INFLIGHT_PER_REPLICA
        self.timeout_s = settings.INFEROPS_BATCH_REQUEST_TIMEOUT_S

    async def run(self) -> None:
        redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5), limits=limits) as http:
            tasks: set[asyncio.Task] = set()
            next_route = next_metrics = 0.0
            stopping_since: float | None = None
            try:
                while self.queue or tasks:
                    now = time.monotonic()
                    if self.progress.stop.is_set():
                        self.queue.clear()
                        stopping_since = stopping_since or now
                        if now - stopping_since > STOP_GRACE_S:
                            break  # the lines in flight are cancelled below; they stay pending
                    if now >= next_route:
                        await self._read_route(redis)
                        next_route = now + 2.0
                    if now >= next_metrics:
                        await asyncio.gather(*(self._adjust(http, t) for t in list(self.targets.values())))
                        next_metrics = now + 0.5
                    for target in self._ready_targets(now):
                        while target.inflight < target.window and self.queue and self.queue[0].not_before <= now:
                            line = self.queue.popleft()
                            target.inflight += 1
                            tasks.add(asyncio.create_task(self._send(http, redis, target, line)))
                    if tasks:
                        done, tasks = await asyncio.wait(tasks, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                        tasks = set(tasks)
                        for task in done:
                            task.result()  # a bug in _send surfaces here
                    else:
                        await asyncio.sleep(0.1)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await redis.aclose()

    def _ready_targets(self, now: float) -> list[Target]:
        if self.paused_reason:
            return []
        targets = [t for t in self.targets.values() if t.failing_until <= now]
        random.shuffle(targets)
        return targets

    async def _read_route(self, redis) -> None:
        raw = await redis.hget(ROUTING_KEY, self.batch.model)
        route = json.loads(raw) if raw else None
        if route is None:
            self.paused_reason = f"the deployment `{self.batch.model}` has no published route"
            return
        degradation = route.get("degradation") or {}
        self.paused_reason = (f"the deployment is degraded (level {degradation.get('level')})"
                              if degradation.get("level") else None)
        seen = set()
        for version in route["versions"]:
            if not version.get("weight"):
                continue
            for replica in version["replicas"]:
                seen.add(replica["id"])
                if replica["id"] not in self.targets:
                    self.targets[replica["id"]] = Target(replica["id"], replica["url"].rstrip("/"),
                                                         version["version"], route.get("backend", Backend.BUILTIN))
        for gone in set(self.targets) - seen:
            if not self.targets[gone].inflight:
                del self.targets[gone]

    async def _adjust(self, http: httpx.AsyncClient, target: Target) -> None:
        """Grow the replica's window while nothing waits there; halve it while interactive requests queue."""
        try:
            response = await http.get(f"{target.url}/metrics", timeout=2)
            running, waiting = _queue_depths(response.text)
        except (httpx.HTTPError, ValueError):
            return
        others = max(0.0, running + waiting - target.inflight)
        if waiting > 0 and others > 0:
            target.window = max(1, target.window // 2)
        elif waiting == 0:
            target.window = min(self.max_window, target.window + 1)

    async def _send(self, http: httpx.AsyncClient, redis, target: Target, line: Line) -> None:
        body = dict(line.body)
        if target.backend == Backend.BUILTIN and self.endpoint != "embeddings":
            body["priority"] = BATCH_PRIORITY
        rid = request_id(self.batch.id, line.custom_id)
        started_at, started = time.time(), time.perf_counter()
        line.attempts += 1
        try:
            response = await http.post(f"{target.url}{self.batch.endpoint}", json=body,
                                       headers={"X-Request-Id": rid})
            status, payload = response.status_code, _json_or_text(response)
        except httpx.HTTPError as exc:
            status, payload = None, str(exc) or type(exc).__name__
        finally:
            target.inflight -= 1
        if status is None or status in RETRYABLE_STATUS:
            if status is None or status >= 500:
                target.failing_until = time.monotonic() + 1.0
            if line.attempts < len(RETRY_DELAYS_S):
                line.not_before = time.monotonic() + RETRY_DELAYS_S[line.attempts - 1]
                self.queue.append(line)
                return
        usage = payload.get("usage") if isinstance(payload, dict) else None
        prompt = int((usage or {}).get("prompt_tokens") or 0)
        completion = int((usage or {}).get("completion_tokens") or 0)
        ok = status == 200
        response_record = None if status is None else {"status_code": status, "request_id": rid, "body": payload}
        record = {"id": f"batch_req_{rid[-24:]}", "custom_id": line.custom_id, "response": response_record,
                  "error": None if status is not None else {"code": "replica_unreachable", "message": payload}}
        event = {"request_id": rid, "time": started_at, "tenant": self.batch.tenant.name,
                 "key_prefix": self.batch.key_prefix, "deployment": self.batch.model, "version": target.version,
                 "replica": target.id, "priority": BATCH_PRIORITY, "endpoint": self.endpoint, "stream": False,
                 "prompt_tokens": prompt, "completion_tokens": completion,
                 "e2e_ms": (time.perf_counter() - started) * 1000, "status": status or 502,
                 "finish_reason": _finish_reason(payload), "retries": line.attempts - 1, "batch_id": self.batch.id,
                 "error_kind": None if ok else ("bad_request" if status and status < 500 else "upstream_error")}
        await _emit(redis, event)
        self.progress.outcomes.append(Outcome(line.number, line.custom_id, ok, record, prompt, completion))


async def _emit(redis, event: dict) -> None:
    """The line's usage event, into the stream the gateways write (its id makes a repeat harmless)."""
    delay = 0.5
    while True:
        try:
            await redis.xadd(USAGE_STREAM, {"e": json.dumps(event)}, maxlen=1_000_000, approximate=True)
            return
        except (OSError, aioredis.RedisError) as exc:
            log.warning("batch %s: usage event not written yet (%s); retrying", event["batch_id"], exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10)


def _queue_depths(text: str) -> tuple[float, float]:
    running = waiting = 0.0
    for row in text.splitlines():
        if row.startswith("vllm:num_requests_running"):
            running += float(row.rsplit(" ", 1)[1])
        elif row.startswith("vllm:num_requests_waiting"):
            waiting += float(row.rsplit(" ", 1)[1])
    return running, waiting


def _json_or_text(response: httpx.Response):
    try:
        return response.json()
    except ValueError:
        return response.text


def _finish_reason(payload) -> str | None:
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason[:32] if isinstance(reason, str) else None
    return None


def feed_in_thread(feeder: Feeder, progress: Progress) -> None:
    """Run the feeder on an event loop of its own while this thread saves progress (the ORM stays here)."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            asyncio.run(feeder.run())
        except BaseException as exc:  # noqa: BLE001 - handed to the other thread
            errors.append(exc)

    thread = threading.Thread(target=work, name=f"batch-{progress.batch.pk}", daemon=True)
    thread.start()
    shown = progress.batch.last_error
    while thread.is_alive():
        thread.join(FLUSH_EVERY_S)
        progress.flush()
        waiting = f"Waiting: {feeder.paused_reason}." if feeder.paused_reason else ""
        if waiting != shown:  # the console says why a batch makes no progress
            Batch.objects.filter(pk=progress.batch.pk).update(last_error=waiting)
            shown = waiting
    progress.flush()
    if errors:
        raise errors[0]


# -- the run -------------------------------------------------------------------------------------------


def run_batch(batch_id: str) -> str:
    """The task's work; returns what happened, in a word or two."""
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None:
        return "no such batch"
    if batch.status == BatchStatus.CANCELLING and batch.in_progress_at is None:  # cancelled while validating
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.CANCELLING).update(
            status=BatchStatus.CANCELLED, cancelled_at=timezone.now())
        return BatchStatus.CANCELLED
    if batch.status == BatchStatus.VALIDATING:
        checked = services.validate(batch)
        if checked.errors:
            services.fail_validation(batch, checked)
            return "failed validation"
        Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.IN_PROGRESS, in_progress_at=timezone.now(), total=checked.lines, model=checked.model)
    attempt = claim(batch_id)
    if attempt is None:
        return "held by another runner" if Batch.objects.filter(pk=batch_id, status=BatchStatus.IN_PROGRESS).exists() \
            else "not running"
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if batch.status == BatchStatus.FINALIZING:  # its runner died while writing the files
        return finalize(batch, attempt)
    done = read_parts(batch)
    progress = Progress(batch, attempt, done)
    progress.flush()
    pending = []
    if not progress.stop.is_set():
        for number, raw in enumerate(services.read_lines(batch.input_file.storage_name), start=1):
            if raw.strip():
                line = parse_line(raw)
                if line["custom_id"] not in done:
                    pending.append(Line(number, line["custom_id"], line["body"]))
    if pending:
        feed_in_thread(Feeder(batch, pending, progress), progress)
    if progress.lost:
        return "taken over by another attempt"
    return finalize(batch, attempt)


def final_status(batch: Batch, done: dict[str, dict]) -> tuple[str, str] | None:
    """How the batch ends, and the timestamp field that says when; None while it should go on. Read
    from the row alone, so a runner that died while finalizing is finished the same way by the next."""
    if batch.cancelling_at is not None:
        return BatchStatus.CANCELLED, "cancelled_at"
    if len(done) >= batch.total:
        return BatchStatus.COMPLETED, "completed_at"
    if timezone.now() >= batch.expires_at:
        return BatchStatus.EXPIRED, "expired_at"
    return None


def finalize(batch: Batch, attempt: int) -> str:
    """Write the output and error files from the parts and end the batch: completed, cancelled or expired."""
    batch.refresh_from_db()
    done = read_parts(batch)
    ending = final_status(batch, done)
    if ending is None:
        return "stopped early"  # a stop without cancel or expiry: the next tick resumes it
    final, stamp = ending
    now = timezone.now()
    if not Batch.objects.filter(pk=batch.pk, attempt=attempt).update(
            status=BatchStatus.FINALIZING, finalizing_at=now, heartbeat_at=now):
        return "taken over by another attempt"
    ordered = sorted(done.values(), key=lambda part: part["line"])
    outputs = [part["record"] for part in ordered if part["ok"]]
    errors = [part["record"] for part in ordered if not part["ok"]]
    if final == BatchStatus.EXPIRED:
        errors += expired_records(batch, done)
    with transaction.atomic():
        changes = {"status": final, stamp: timezone.now(), "completed": len(outputs),
                   "failed": len(done) - len(outputs), "heartbeat_at": None}
        if outputs:
            changes["output_file"] = services.stored_file(
                content=services.jsonl(outputs), tenant_id=batch.tenant_id, key_prefix=batch.key_prefix,
                filename=f"{batch.id}_output.jsonl")
        if errors:
            changes["error_file"] = services.stored_file(
                content=services.jsonl(errors), tenant_id=batch.tenant_id, key_prefix=batch.key_prefix,
                filename=f"{batch.id}_error.jsonl")
        Batch.objects.filter(pk=batch.pk).update(**changes)
    delete_parts(batch)
    return final


def expired_records(batch: Batch, done: dict[str, dict]) -> list[dict]:
    """OpenAI's error lines for the requests an expired batch never ran."""
    records = []
    for raw in services.read_lines(batch.input_file.storage_name) if batch.input_file else ():
        if raw.strip():
            custom_id = parse_line(raw)["custom_id"]
            if custom_id not in done:
                records.append({"id": f"batch_req_{request_id(batch.id, custom_id)[-24:]}", "custom_id": custom_id,
                                "response": None, "error": {"code": "batch_expired",
                                                            "message": "This request could not be executed before the "
                                                                       "completion window expired."}})
    return records


def delete_parts(batch: Batch) -> None:
    storage = services.storage()
    with contextlib.suppress(FileNotFoundError):
        for name in storage.listdir(batch.part_prefix)[1]:
            storage.delete(f"{batch.part_prefix}/{name}")


def tick() -> dict:
    """Beat task: hand the batches whose runner stopped beating to another worker; and, rarely, enqueue
    again a batch no runner ever took (its message lost), without piling up copies behind a busy queue."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.INFEROPS_BATCH_STALE_S)
    forgotten = now - timedelta(seconds=settings.INFEROPS_BATCH_STALE_S * NEVER_STARTED_FACTOR)
    lost = Batch.objects.filter(
        Q(status__in=RESUMABLE, heartbeat_at__lt=stale)
        | Q(status__in=(BatchStatus.VALIDATING, *RESUMABLE), heartbeat_at__isnull=True, enqueued_at__lt=forgotten))
    resumed = []
    for batch_id in lost.values_list("pk", flat=True):
        services.enqueue_run(batch_id)
        resumed.append(batch_id)
    return {"resumed": resumed}
