"""`inferops gateway`: the data-plane door for API clients (OpenAI-compatible, /v1).

A plain ASGI app rather than a framework router: every API request runs as one coroutine whose
`finally` is the single place that releases its rate-limit slots and writes its one usage event,
whatever way it ended (answer, refusal, upstream failure, client gone, bug). A watcher on the
ASGI `receive` channel cancels that coroutine when the client disconnects, which closes the
upstream stream so the replica aborts the request too.

Every API answer carries `X-Request-Id`: the client's own when it sent a usable one (printable,
at most 128 characters), else the gateway's; the replica gets the same id, and a well-formed W3C
`traceparent` (with its `tracestate`) unchanged. The usage event's `request_id` is always the
gateway's (the ledger's idempotency key, so a client reusing an id loses no usage);
`client_request_id` holds the client's. A non-streamed answer's TTFT and TPOT come from the
replica's `Server-Timing` header (`ttft_source` "server"); a stream's are timed here ("gateway").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from runtime.gateway import clock, heartbeat, jsonbody, jsonlog
from runtime.gateway.activator import SHUTDOWN, Activator, HoldRefused
from runtime.gateway.contract import (
    DEGRADED,
    INTERNAL,
    LATE,
    PREVIEW_SUFFIX,
    SHED,
    hash_api_key,
    slo_targets_field,
)
from runtime.gateway.control_plane import ControlPlane, route_of
from runtime.gateway.http_protocol import DEFAULT_READ_TIMEOUT_S, protocol_class
from runtime.gateway.limits import Admission, RateLimiter, Refusal, estimate_prompt_tokens
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.proxy import CONNECT, TIMEOUT, Opened, StreamObserver, Upstream, UpstreamFailure, read_usage
from runtime.gateway.router import NoReplica, Router, Saturated, affinity_key
from runtime.gateway.state import ApiKey, RedisHealth, Route, StateSync
from runtime.gateway.usage import UsageSink
from runtime.gateway.verdicts import TtftVerdicts, TtftWatch

logger = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"
MAX_REQUEST_ID = 128
# W3C Trace Context: version 00 exactly; a later version may append fields; ff is invalid.
TRACEPARENT = re.compile(rb"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE = 512


@dataclass
class GatewaySettings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    instance: str = "gateway"
    advertise_address: str | None = None  # host:port Prometheus scrapes; None: not announced
    spool_dir: Path = Path(".inferops/gateway-spool")
    redis_down_limits: str = "open"  # "open": admit without limits; "closed": answer 503
    max_outstanding_per_replica: int = 64
    affinity_slack: int = 4
    max_attempts: int = 3
    connect_timeout_s: float = 2.0
    first_token_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    concurrency_lease_s: float = 60.0
    max_body_bytes: int = 8 * 1024 * 1024
    state_poll_s: float = 1.0
    failure_threshold: int = 3
    failure_window_s: float = 10.0
    ejection_s: float = 15.0
    # The Files and Batches API is the control plane's (control_plane.py): where it listens, the
    # largest file upload forwarded (OpenAI's batch input limit), the longest silence either way.
    control_plane_url: str = "http://127.0.0.1:8000"
    max_file_bytes: int = 200 * 1000 * 1000
    control_plane_timeout_s: float = 300.0


class GatewayError(Exception):
    """An OpenAI-style error answer; `kind` is the usage event's error_kind."""

    def __init__(self, status: int, message: str, error_type: str, kind: str, param: str | None = None,
                 retry_after_s: int | None = None, body: bytes | None = None,
                 content_type: str = "application/json", code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.kind = kind
        self.param = param
        self.retry_after_s = retry_after_s
        self.content_type = content_type
        self.body = body if body is not None else json.dumps(
            {"error": {"message": message, "type": error_type, "param": param,
                       "code": status if code is None else code}}).encode()


def effective_priority(key: ApiKey, asked: Any) -> int:
    """The key's priority, or a lower one the client asks for: a client may yield to its own other
    work, never jump the queue past its key's priority."""
    if asked is None:
        return key.priority
    if isinstance(asked, bool) or not isinstance(asked, int):
        raise _bad_request(f"`priority` must be an integer at most your key's priority ({key.priority}).",
                           "priority")
    return min(asked, key.priority)


@dataclass
class RequestRecord:
    """One API request as its usage event will tell it."""

    endpoint: str
    request_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex}")
    client_request_id: str | None = None  # the client's X-Request-Id, when usable
    trace_headers: dict[str, str] = field(default_factory=dict)  # traceparent/tracestate to pass on
    # The tenant's SLO targets for a built-in replica (the only client headers passed on are the two above).
    slo_headers: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=clock.now)  # epoch by Redis's clock, the event's "time"
    started: float = field(default_factory=time.perf_counter)
    key: ApiKey | None = None
    priority: int = 0  # the request's effective priority: its key's, or lower if the client asked
    degradation_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # what degradation did
    ratelimit_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-*
    deployment: str | None = None
    version: int | None = None
    replica: int | None = None
    failed_replica: int | None = None  # the first replica that failed it before a retry
    stream: bool = False
    prompt_estimate: int = 0
    sent_upstream: bool = False
    usage: dict[str, Any] | None = None
    content_chunks: int = 0
    first_chunk_at: float | None = None
    server_timing: tuple[float | None, float | None] = (None, None)  # the replica's TTFT, TPOT (ms)
    finish_reason: str | None = None
    status: int = 500
    error_kind: str | None = None
    retries: int = 0
    held_ms: float | None = None  # held while its parked deployment started a replica
    admission: Admission | None = None
    ttft_watch: TtftWatch | None = None  # early TTFT verdicts, for a deployment with deadlines
    headers_sent: bool = False
    response_done: bool = False
    client_gone: bool = False

    @property
    def public_id(self) -> str:
        """The id the client and the replica see."""
        return self.client_request_id or self.request_id

    def response_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", self.public_id.encode()), *self.ratelimit_headers, *self.degradation_headers]

    def tokens(self) -> tuple[int, int]:
        if self.usage:
            return int(self.usage.get("prompt_tokens") or 0), int(self.usage.get("completion_tokens") or 0)
        if not self.sent_upstream:
            return 0, 0
        # No usage from the replica (client gone, stream cut): the best estimate we have.
        return self.prompt_estimate, self.content_chunks

    def event(self, now: float) -> dict[str, Any]:
        prompt_tokens, completion_tokens = self.tokens()
        e2e = now - self.started
        ttft = self.first_chunk_at - self.started if self.first_chunk_at is not None else None
        tpot = (e2e - ttft) / (completion_tokens - 1) if ttft is not None and completion_tokens > 1 else None
        ttft_ms, tpot_ms = (ttft * 1000 if ttft is not None else None), (tpot * 1000 if tpot is not None else None)
        source = "gateway" if ttft_ms is not None else None
        if ttft_ms is None and self.server_timing[0] is not None:
            (ttft_ms, tpot_ms), source = self.server_timing, "server"
            # The replica times from its own arrival; the client waited through the hold too.
            ttft_ms += self.held_ms or 0.0
        return {
            "request_id": self.request_id, "client_request_id": self.client_request_id, "time": self.started_at,
            "tenant": self.key.tenant if self.key else None, "key_prefix": self.key.prefix if self.key else None,
            "deployment": self.deployment, "version": self.version, "replica": self.replica,
            "failed_replica": self.failed_replica,
            "priority": self.priority, "endpoint": self.endpoint, "stream": self.stream,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "ttft_source": source,
            "e2e_ms": e2e * 1000, "status": self.status, "finish_reason": self.finish_reason,
            "error_kind": self.error_kind, "retries": self.retries, "held_ms": self.held_ms,
        }


def client_request_id(value: bytes | None) -> str | None:
    """The client's X-Request-Id if usable (printable ASCII, 1-128 characters), else None."""
    if value is None:
        return None
    value = value.strip()
    if not 0 < len(value) <= MAX_REQUEST_ID or not all(0x20 <= byte < 0x7f for byte in value):
        return None
    return value.decode("ascii")


def trace_headers(scope: dict) -> dict[str, str]:
    """traceparent (and tracestate) to pass to the replica unchanged, when traceparent is well-formed."""
    parent = _header(scope, b"traceparent")
    if parent is None or not TRACEPARENT.match(parent) or (parent[:2] == b"00" and len(parent) != 55) \
            or (len(parent) > 55 and parent[55:56] != b"-"):
        return {}
    headers = {"traceparent": parent.decode("ascii")}
    # Several tracestate headers are one list (W3C Trace Context), passed on as one header.
    state = b",".join(value for key, value in scope["headers"] if key == b"tracestate")
    if state and len(state) <= MAX_TRACESTATE and all(0x20 <= byte < 0x7f for byte in state):
        headers["tracestate"] = state.decode("ascii")
    return headers


def server_timing(value: bytes | None) -> tuple[float | None, float | None]:
    """TTFT and TPOT in ms from a `Server-Timing: ttft;dur=12.3, tpot;dur=4.5` header; a metric
    without a usable `dur` (missing, not a number, negative, infinite) counts as not sent. Like
    the Server Timing spec for parameters, the first occurrence of a name wins."""
    found: dict[str, float] = {}
    for metric in (value or b"").decode("latin-1").split(","):
        name, *params = (part.strip() for part in metric.split(";"))
        name = name.lower()
        if name in found:
            continue
        for param in params:
            key, _, number = param.partition("=")
            if key.strip().lower() == "dur":
                try:
                    duration = float(number.strip().strip('"'))
                except ValueError:
                    break
                if 0 <= duration < float("inf"):
                    found[name] = duration
                break
    return found.get("ttft"), found.get("tpot")


def _header(scope: dict, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def _read_body(scope: dict, receive: Any, limit: int) -> bytes:
    too_large = GatewayError(413, f"Request body larger than {limit} bytes.", "BadRequestError", "bad_request")
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and (len(declared) > 15 or int(declared) > limit):
        raise too_large  # refused before a byte of it is read
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


def _bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "BadRequestError", "bad_request", param)


class Gateway:
    """The ASGI application; one per process (or several in a test)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.health = RedisHealth(retry_s=1.0)
        self.health.listeners.append(lambda up: self.metrics.redis_up.set(1 if up else 0))
        self.router = Router(settings.max_outstanding_per_replica, settings.affinity_slack,
                             settings.failure_threshold, settings.failure_window_s, settings.ejection_s)
        self.metrics.watch_replicas(self.router.snapshot)
        self.redis: aioredis.Redis | None = None
        self.state: StateSync | None = None
        self.limiter: RateLimiter | None = None
        self.usage: UsageSink | None = None
        self.verdicts: TtftVerdicts | None = None
        self.activator: Activator | None = None
        self.upstream: Upstream | None = None
        self.control_plane = ControlPlane(settings.control_plane_url, settings.max_file_bytes,
                                          settings.connect_timeout_s, settings.control_plane_timeout_s)
        self._background: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        s = self.settings
        self.redis = aioredis.Redis.from_url(s.redis_url, socket_timeout=1.0, socket_connect_timeout=0.5,
                                             max_connections=512)
        self.state = StateSync(self.redis, self.health, s.state_poll_s)
        self.limiter = RateLimiter(self.redis, s.concurrency_lease_s)
        self.usage = UsageSink(self.redis, s.spool_dir / f"{s.instance}.jsonl", self.health,
                               on_spool_depth=self.metrics.spool_depth.set)
        self.verdicts = TtftVerdicts(self.redis, self.health)
        self.activator = Activator(self.state, self.redis, self.health, self.metrics, s.instance)
        self.upstream = Upstream(s.connect_timeout_s, s.first_token_timeout_s, s.request_timeout_s)
        self.control_plane.start()
        await self.state.start()
        await self.usage.start()
        await self.verdicts.start()
        self._renewer = asyncio.create_task(self._renew_leases())
        if s.advertise_address:
            self._heartbeat = asyncio.create_task(heartbeat.beat(self.redis, s.instance, s.advertise_address))
        logger.info("gateway %s: %d deployments, %d keys, redis %s", s.instance, len(self.state.snapshot.routes),
                    len(self.state.snapshot.keys), "up" if self.health.up else "DOWN")

    async def shutdown(self) -> None:
        await self.stop_holding()
        if self._renewer is not None:
            self._renewer.cancel()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await heartbeat.leave(self.redis, self.settings.instance)
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.state is not None:
            await self.state.stop()
        if self.usage is not None:
            await self.usage.stop()
        if self.verdicts is not None:
            await self.verdicts.stop()
        if self.upstream is not None:
            self.upstream.close()
        await self.control_plane.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def stop_holding(self) -> None:
        """Answer every request held for a parked deployment with a 503 now, rather than let it
        wait out the server's graceful shutdown and be dropped (GatewayServer calls it first)."""
        if self.activator is not None:
            await self.activator.close()

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.settings.concurrency_lease_s / 3)
            if self.limiter.live and self.health.worth_trying():
                try:
                    await self.limiter.renew_leases()
                except (RedisError, OSError) as exc:
                    self.health.mark_down(exc)

    # -- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None and method == "POST":
            await self._api_request(scope, receive, send, endpoint)
        elif path == "/v1/models" and method == "GET":
            await self._models(scope, send)
        elif (route := route_of(path)) is not None:
            await self._control_plane_request(scope, receive, send, route)
        elif path == "/health" and method == "GET":
            await self._health(send)
        elif path == "/metrics" and method == "GET":
            await _send_whole(send, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        else:
            error = GatewayError(404, f"No route {method} {path}.", "NotFoundError", "not_found")
            await _send_whole(send, 404, error.body)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    logger.exception("gateway failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _health(self, send: Any) -> None:
        snapshot = self.state.snapshot
        body = {"status": "ok", "redis": "up" if self.health.up else "down", "deployments": len(snapshot.routes),
                "keys": len(snapshot.keys), "usage_spool_depth": self.usage.spool_depth}
        await _send_whole(send, 200, json.dumps(body).encode())

    async def _models(self, scope: dict, send: Any) -> None:
        try:
            key = await self._authenticate(scope)
        except GatewayError as error:
            await _send_whole(send, error.status, error.body)
            return
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "inferops", "task": route.task}
                for name, route in sorted(self.state.snapshot.routes.items()) if key.may_use(name)]
        await _send_whole(send, 200, json.dumps({"object": "list", "data": data}).encode())

    async def _control_plane_request(self, scope: dict, receive: Any, send: Any, route: str) -> None:
        """Files and batches: the key checked here as for inference, the rest the control plane's."""
        request_id = client_request_id(_header(scope, b"x-request-id")) or f"gw-{uuid.uuid4().hex}"
        jsonlog.REQUEST_ID.set(request_id)
        try:
            await self._authenticate(scope)
        except GatewayError as error:
            self.metrics.control_plane_requests.labels(route, str(error.status)).inc()
            await _send_whole(send, error.status, error.body, headers=[(b"x-request-id", request_id.encode())])
            return
        status = 500
        try:
            status = await self.control_plane.forward(scope, receive, send, request_id)
        finally:
            self.metrics.control_plane_requests.labels(route, str(status)).inc()

    # -- one API request ---------------------------------------------------------------------

    async def _api_request(self, scope: dict, receive: Any, send: Any, endpoint: str) -> None:
        record = RequestRecord(endpoint, client_request_id=client_request_id(_header(scope, b"x-request-id")),
                               trace_headers=trace_headers(scope))
        jsonlog.REQUEST_ID.set(record.public_id)
        task = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        try:
            body = await _read_body(scope, receive, self.settings.max_body_bytes)
            watcher = asyncio.create_task(self._watch_disconnect(receive, record, task))
            await self._serve(scope, body, send, record)
        except GatewayError as error:
            record.status, record.error_kind = error.status, error.kind
            if not record.headers_sent:
                headers = [(b"retry-after", str(error.retry_after_s).encode())] if error.retry_after_s else []
                headers += record.response_headers()
                await self._respond(send, record, error.status, error.body, error.content_type, headers)
        except (asyncio.CancelledError, ClientGone) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if not record.client_gone:
                    record.error_kind = record.error_kind or INTERNAL
                    raise  # the server is shutting down: not ours to swallow
                task.uncancel()
            record.client_gone = True
            record.error_kind = "client_disconnect"
            if not record.headers_sent:
                record.status = CLIENT_CLOSED_REQUEST
        except Exception:
            logger.exception("request %s failed", record.request_id)
            record.error_kind = INTERNAL
            if not record.headers_sent:
                record.status = 500
                error = GatewayError(500, "Internal gateway error.", "InternalServerError", INTERNAL)
                with contextlib.suppress(Exception):
                    await self._respond(send, record, 500, error.body, headers=record.response_headers())
        finally:
            if watcher is not None:
                watcher.cancel()
            self._finish(record)

    @staticmethod
    async def _watch_disconnect(receive: Any, record: RequestRecord, task: asyncio.Task[Any]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # After the last byte went out the server reports a disconnect too; that one is normal.
        if not record.response_done:
            record.client_gone = True
            task.cancel()

    def _finish(self, record: RequestRecord) -> None:
        """Synchronous on purpose: nothing may interrupt it between the answer and the event."""
        if record.ttft_watch is not None:
            record.ttft_watch.close()
        event = record.event(time.perf_counter())
        self.usage.emit(event)
        label = record.deployment if record.deployment in self.state.snapshot.routes else ""
        self.metrics.requests.labels(label, str(record.status)).inc()
        self.metrics.e2e.labels(label).observe(event["e2e_ms"] / 1000)
        if event["ttft_ms"] is not None:
            self.metrics.ttft.labels(label).observe(event["ttft_ms"] / 1000)
        if event["tpot_ms"] is not None:
            self.metrics.tpot.labels(label).observe(event["tpot_ms"] / 1000)
        if record.admission is not None:
            used = event["prompt_tokens"] + event["completion_tokens"]
            self._spawn(self._release(record.admission, used))

    async def _release(self, admission: Admission, used_tokens: int) -> None:
        try:
            await self.limiter.release(admission, used_tokens)
        except (RedisError, OSError) as exc:
            # The slot's lease runs out by itself (it is no longer renewed).
            self.health.mark_down(exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _serve(self, scope: dict, body: bytes, send: Any, record: RequestRecord) -> None:
        snapshot = self.state.snapshot
        record.key = key = await self._authenticate(scope)
        try:
            payload = jsonbody.loads(body)
        except jsonbody.MalformedBody as exc:
            raise _bad_request(f"Malformed JSON body: {exc}", "body") from None
        if not isinstance(payload, dict):
            raise _bad_request("The request body must be a JSON object.", "body")
        deployment = payload.get("model")
        if not isinstance(deployment, str) or not deployment:
            raise _bad_request("`model` (a deployment name) is required.", "model")
        record.deployment = deployment
        route = snapshot.routes.get(deployment)
        if route is None:
            raise GatewayError(404, f"The deployment `{deployment}` does not exist.", "NotFoundError", "not_found",
                               "model")
        if not key.may_use(deployment):
            raise GatewayError(403, f"API key {key.prefix} may not use the deployment `{deployment}`.",
                               "PermissionDeniedError", "forbidden", "model")
        record.stream = payload.get("stream") is True and record.endpoint != "embeddings"
        record.prompt_estimate = estimate_prompt_tokens(payload)
        record.priority = effective_priority(key, payload.get("priority"))
        route, changed = self._degrade(route, payload, record)
        if deployment.endswith(PREVIEW_SUFFIX):
            # A rollout's candidate serves under the deployment's own name.
            payload["model"] = deployment.removesuffix(PREVIEW_SUFFIX)
            changed = True
        # The built-in engine schedules and preempts generations by priority (higher first). vLLM
        # schedules first come first served unless started for priorities (whose order is the
        # opposite), and embeddings are not scheduled by it: those get no priority field at all.
        upstream_priority = record.priority if route.backend == "builtin" and record.endpoint != "embeddings" else None
        if payload.get("priority") != upstream_priority:
            payload.pop("priority", None)
            if upstream_priority is not None:
                payload["priority"] = upstream_priority
            changed = True
        strip_usage = False
        if record.stream:
            options = payload.get("stream_options")
            # Asked for unless the client did; a stream_options of the wrong shape goes on as it came,
            # for the replica to refuse.
            include_usage = options.get("include_usage") if isinstance(options, dict) else True
            if options is None or include_usage is None or include_usage is False:
                # The gateway needs the token counts; the client gets the stream it asked for.
                payload["stream_options"] = {**(options or {}), "include_usage": True}
                changed = strip_usage = True
        if changed:
            body = json.dumps(payload).encode()
        if upstream_priority is not None:  # a generation on a built-in replica: its tenant's targets
            targets = self.state.snapshot.slo_targets.get(slo_targets_field(route.deployment, key.tenant))
            record.slo_headers = {name.decode(): value.decode() for name, value in targets.headers()} if targets else {}
        deadlines = self.state.snapshot.ttft_deadlines.get(route.deployment) if record.stream else None
        if deadlines:
            record.ttft_watch = self.verdicts.watch(route.deployment, deadlines, record.started)
        await self._proxy(scope["path"], route, key, body, payload, send, record, strip_usage)

    def _degrade(self, route: Route, payload: dict, record: RequestRecord) -> tuple[Route, bool]:
        """Apply the deployment's degradation level: shed low priorities, cap max_tokens, send a
        share to the fallback deployment. Returns the route to serve from and whether `payload` changed."""
        degradation = route.degradation
        if degradation is None:
            return route, False
        record.degradation_headers.append((b"x-inferops-degradation-level", str(degradation.level).encode()))
        if degradation.shed_below_priority is not None and record.priority < degradation.shed_below_priority:
            self.metrics.shed.labels(route.deployment, DEGRADED).inc()
            raise GatewayError(
                503, f"`{route.deployment}` is degraded (level {degradation.level} {degradation.name}): requests "
                f"below priority {degradation.shed_below_priority} are shed for now (this one has "
                f"{record.priority}). Retry later, or use a key of a higher priority.",
                "ServiceUnavailableError", DEGRADED, None, degradation.retry_after_s, code=DEGRADED)
        changed = False
        cap = degradation.max_tokens_cap
        if cap is not None and record.endpoint != "embeddings":
            asked = [payload.get(name) for name in ("max_tokens", "max_completion_tokens")]
            if all(value is None for value in asked):
                payload["max_tokens"] = cap
                changed = True
            for name, value in zip(("max_tokens", "max_completion_tokens"), asked, strict=True):
                if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                    payload[name] = cap
                    changed = True
            if changed:
                record.degradation_headers.append((b"x-inferops-max-tokens-capped", str(cap).encode()))
        fallback = degradation.fallback
        if fallback is not None and fallback.takes(record.priority, random.random()):
            target = self.state.snapshot.routes.get(fallback.deployment)
            if target is not None and target.has_ready_replica:
                # The fallback's replicas serve under its own name; the usage event says who served.
                payload["model"] = record.deployment = fallback.deployment
                record.degradation_headers.append((b"x-inferops-fallback", fallback.deployment.encode()))
                return target, True
        return route, changed

    async def _authenticate(self, scope: dict) -> ApiKey:
        header = _header(scope, b"authorization")
        if header is None or not header[:7].lower() == b"bearer ":
            raise GatewayError(401, "Missing API key: send `Authorization: Bearer <key>`.", "AuthenticationError",
                               "auth")
        key = await self.state.find_key(hash_api_key(header[7:].strip().decode(errors="replace")))
        if key is None:
            raise GatewayError(401, "Invalid API key.", "AuthenticationError", "auth")
        if key.expired(clock.now()):
            raise GatewayError(401, f"API key {key.prefix} has expired.", "AuthenticationError", "auth")
        return key

    async def _admit(self, key: ApiKey, record: RequestRecord) -> Admission | None:
        if not RateLimiter.needed(key):
            return None
        if self.health.worth_trying():
            try:
                result = await self.limiter.admit(key, record.request_id, record.prompt_estimate)
            except (RedisError, OSError) as exc:
                self.health.mark_down(exc)
            else:
                self.health.mark_up()
                if isinstance(result, Refusal):
                    record.ratelimit_headers = result.headers()
                    self.metrics.rate_limited.labels(result.scope, result.limit_name).inc()
                    raise GatewayError(429, result.message, "RateLimitError", "rate_limited", None,
                                       result.retry_after_s)
                record.ratelimit_headers = result.ratelimit_headers()
                return result
        if self.settings.redis_down_limits == "closed":
            raise GatewayError(503, "Rate limits cannot be checked (Redis unreachable) and the gateway "
                               "fails closed.", "ServiceUnavailableError", SHED, None, 1)
        self.metrics.limits_bypassed.inc()
        return None

    async def _proxy(self, path: str, route: Route, key: ApiKey, body: bytes, payload: dict, send: Any,
                     record: RequestRecord, strip_usage: bool) -> None:
        tried: set[str] = set()
        last_failure: UpstreamFailure | None = None
        held = False
        prefix = affinity_key(payload)
        while True:
            try:
                choice = self.router.choose(route, prefix, tried)
            except Saturated:
                self.metrics.shed.labels(route.deployment, "saturated").inc()
                raise GatewayError(503, f"Every replica of `{route.deployment}` is saturated; retry shortly.",
                                   "ServiceUnavailableError", SHED, None, 1) from None
            except NoReplica:
                if last_failure is not None:
                    raise _final_failure(last_failure) from None
                # A rollout's preview has no replica only while its candidate is not ready: nothing to wake.
                if not held and route.scale_from_zero is not None and not route.deployment.endswith(PREVIEW_SUFFIX):
                    route = await self._hold(route, record)
                    held = True
                    continue
                self.metrics.shed.labels(route.deployment, "no_replica").inc()
                raise GatewayError(503, f"No ready replica serves `{route.deployment}`.", "ServiceUnavailableError",
                                   SHED, None, 1) from None
            # Counted before any await, so concurrent requests see this one and the cap holds.
            self.router.started(choice.replica)
            try:
                if not tried:
                    # Admitted only once a replica can take it: a shed request costs the tenant nothing.
                    record.admission = await self._admit(key, record)
                else:
                    record.retries += 1
                    self.metrics.retries.labels(route.deployment).inc()
                tried.add(choice.replica.url)
                record.version, record.replica = choice.version, choice.replica.id
                record.sent_upstream = True
                try:
                    opened = await self.upstream.open(choice.replica.url + path, body, record.stream,
                                                      {"X-Request-Id": record.public_id, **record.trace_headers,
                                                       **record.slo_headers})
                except UpstreamFailure as failure:
                    # Unreachable or refused: no work done. Timed out: the replica may have done it.
                    record.sent_upstream = failure.kind == TIMEOUT
                    if record.failed_replica is None:
                        record.failed_replica = choice.replica.id
                    last_failure = failure
                    self.metrics.upstream_errors.labels(route.deployment, failure.kind).inc()
                    if self.router.record_failure(choice.replica):
                        self.metrics.ejections.labels(route.deployment).inc()
                        logger.warning("ejected replica %s of %s: %s", choice.replica.url, route.deployment, failure)
                    if len(tried) >= self.settings.max_attempts:
                        raise _final_failure(failure) from None
                    continue
                try:
                    await self._relay(opened, send, record, strip_usage)
                finally:
                    opened.close()
                return
            finally:
                self.router.finished(choice.replica)

    async def _hold(self, route: Route, record: RequestRecord) -> Route:
        """Hold the request while its parked deployment starts a replica; returns the route that
        lists it (the degradation and fallback decisions already made stand)."""
        held_from = time.perf_counter()
        try:
            await self.activator.hold(route.deployment, route.scale_from_zero)
        except HoldRefused as refused:
            if refused.outcome != SHUTDOWN:
                self.metrics.shed.labels(route.deployment, f"hold_{refused.outcome}").inc()
            raise GatewayError(503, str(refused), "ServiceUnavailableError", SHED, None,
                               refused.retry_after_s) from None
        finally:
            # About 0 for a request refused by a full queue: it reached the hold and waited nothing.
            record.held_ms = (time.perf_counter() - held_from) * 1000
        refreshed = self.state.snapshot.routes.get(route.deployment)
        if refreshed is None:
            raise GatewayError(404, f"The deployment `{route.deployment}` was deleted while its request was held.",
                               "NotFoundError", "not_found", "model")
        return refreshed

    async def _relay(self, opened: Opened, send: Any, record: RequestRecord, strip_usage: bool) -> None:
        extra = record.response_headers()
        if not opened.streaming:
            if opened.status == 200:
                record.usage, record.finish_reason = read_usage(opened.first)
                record.server_timing = server_timing(opened.response.headers.get(b"server-timing"))
            elif opened.refused_late:
                # The engine could no longer meet the request's TTFT (--slo-reject-late): its 503 and
                # Retry-After go to the client as they are, booked as shed by the engine.
                record.error_kind = LATE
                self.metrics.shed.labels(record.deployment, LATE).inc()
                retry_after = opened.response.headers.get(b"retry-after")
                extra = [*extra, *([(b"retry-after", retry_after)] if retry_after else [])]
            else:
                record.error_kind = "not_found" if opened.status == 404 else "bad_request"
            await self._respond(send, record, opened.status, opened.first, opened.content_type, extra)
            return
        observer = StreamObserver(strip_usage)
        record.status = opened.status
        record.headers_sent = True
        await send({"type": "http.response.start", "status": opened.status,
                    "headers": [(b"content-type", opened.content_type.encode()), (b"cache-control", b"no-cache"),
                                *extra]})
        watch = record.ttft_watch
        try:
            out = observer.feed(opened.first, time.perf_counter())
            if watch is not None and observer.first_chunk_at is not None:
                watch.first_token(observer.first_chunk_at)
                watch = None
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            async for chunk in opened.remaining():
                out = observer.feed(chunk, time.perf_counter())
                if watch is not None and observer.first_chunk_at is not None:
                    watch.first_token(observer.first_chunk_at)
                    watch = None
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except UpstreamFailure as failure:  # the replica broke the stream after it started: too late to retry
            record.error_kind = failure.kind
            self.metrics.upstream_errors.labels(record.deployment, failure.kind).inc()
            # Like vLLM for failures after the headers: an error event and no [DONE], so clients
            # (the openai SDK raises on it) cannot take the cut stream for a complete answer.
            broken = GatewayError(502, f"The replica failed mid-stream: {failure}", "InternalServerError", failure.kind)
            await send({"type": "http.response.body", "body": b"data: " + broken.body + b"\n\n", "more_body": True})
        finally:
            record.usage = observer.usage
            record.finish_reason = observer.finish_reason
            record.first_chunk_at = observer.first_chunk_at
            record.content_chunks = observer.content_chunks
        if observer.saw_error and record.error_kind is None:
            record.error_kind = "upstream_error"
        record.response_done = True
        await send({"type": "http.response.body", "body": observer.leftover(), "more_body": False})

    @staticmethod
    async def _respond(send: Any, record: RequestRecord, status: int, body: bytes,
                       content_type: str = "application/json",
                       headers: list[tuple[bytes, bytes]] | None = None) -> None:
        record.status = status
        record.headers_sent = True
        record.response_done = True
        await _send_whole(send, status, body, content_type, headers)


def _final_failure(failure: UpstreamFailure) -> GatewayError:
    if failure.status is not None and failure.body:
        return GatewayError(failure.status, str(failure), "InternalServerError", failure.kind,
                            body=failure.body, content_type=failure.content_type)
    status = 504 if failure.kind == TIMEOUT else 502
    kind_text = "timed out" if failure.kind == TIMEOUT else "failed"
    label = "connect" if failure.kind == CONNECT else "request"
    return GatewayError(status, f"Upstream {label} {kind_text}: {failure}", "ServiceUnavailableError", failure.kind)


async def _send_whole(send: Any, status: int, body: bytes, content_type: str = "application/json",
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = GatewaySettings()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind (default: %(default)s)")
    parser.add_argument("--redis-url", default=None, help="Redis with routing, keys, limits, usage "
                        "(default: $REDIS_URL, else redis://127.0.0.1:6379/0)")
    parser.add_argument("--instance", default=None,
                        help="name of this gateway (spool file name; default: <hostname>-<port>)")
    parser.add_argument("--advertise-address", default=None,
                        help="host:port other machines reach this gateway at, announced in Redis for "
                             "Prometheus service discovery (default: the bound host and port, or this "
                             "machine's hostname when bound to all addresses)")
    parser.add_argument("--spool-dir", default=None,
                        help="usage spool directory (default: $INFEROPS_DATA_DIR/gateway-spool)")
    parser.add_argument("--redis-down-limits", choices=["open", "closed"], default=defaults.redis_down_limits,
                        help="when Redis is unreachable: serve without rate limits (open) or answer 503 "
                             "(closed) (default: %(default)s)")
    parser.add_argument("--max-outstanding-per-replica", type=int, default=defaults.max_outstanding_per_replica,
                        help="requests in flight to one replica before it counts as saturated (shed "
                             "beyond) (default: %(default)s)")
    parser.add_argument("--affinity-slack", type=int, default=defaults.affinity_slack,
                        help="how many more outstanding requests than the least loaded replica the "
                             "prefix-preferred replica may have and still be chosen (default: %(default)s)")
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                        help="replicas tried per request before the first byte (1 = no retry) "
                             "(default: %(default)s)")
    parser.add_argument("--connect-timeout", type=float, default=defaults.connect_timeout_s,
                        help="seconds to connect to a replica (default: %(default)s)")
    parser.add_argument("--first-token-timeout", type=float, default=defaults.first_token_timeout_s,
                        help="seconds a stream may wait for its first chunk (and between chunks) "
                             "(default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                        help="seconds a non-streamed request may take (default: %(default)s)")
    parser.add_argument("--concurrency-lease", type=float, default=defaults.concurrency_lease_s,
                        help="seconds a concurrency slot lives unless renewed (frees slots of a crashed "
                             "gateway) (default: %(default)s)")
    parser.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="seconds a client has to send a whole request, headers and body, from connecting or "
                             "from the request's first byte; later it gets a 408 and the connection is closed "
                             "(slow clients and slow-loris attacks) (default: %(default)s)")
    parser.add_argument("--control-plane-url", type=_http_url, default=None,
                        help="the web app (control plane) that serves /v1/files and /v1/batches, which the gateway "
                             "forwards there (default: $INFEROPS_CONTROL_PLANE_URL, else "
                             f"{defaults.control_plane_url})")
    parser.add_argument("--max-file-bytes", type=_positive_int, default=defaults.max_file_bytes,
                        help="largest file upload forwarded to the control plane; a larger body gets a 413 "
                             "(default: %(default)s, OpenAI's batch input limit)")
    parser.add_argument("--control-plane-timeout", type=float, default=defaults.control_plane_timeout_s,
                        help="seconds the control plane may stay silent while a files or batches request is "
                             "sent or answered, after which the client gets a 504 (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="log level (default: %(default)s)")


def _http_url(value: str) -> str:
    url = value.strip()
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http:// or https:// URL")
    return url.rstrip("/")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not positive")
    return number


def _control_plane_url_from_env() -> str:
    try:
        return _http_url(os.environ.get("INFEROPS_CONTROL_PLANE_URL") or GatewaySettings.control_plane_url)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"INFEROPS_CONTROL_PLANE_URL: {exc}") from None


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    data_dir = Path(os.environ.get("INFEROPS_DATA_DIR", ".inferops")).expanduser()
    spool_dir = Path(args.spool_dir) if args.spool_dir else data_dir / "gateway-spool"
    return GatewaySettings(
        redis_url=args.redis_url or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0",
        instance=args.instance or f"{socket.gethostname()}-{args.port}",
        spool_dir=spool_dir,
        advertise_address=args.advertise_address or advertised(args.host, args.port),
        redis_down_limits=args.redis_down_limits,
        max_outstanding_per_replica=args.max_outstanding_per_replica,
        affinity_slack=args.affinity_slack,
        max_attempts=args.max_attempts,
        connect_timeout_s=args.connect_timeout,
        first_token_timeout_s=args.first_token_timeout,
        request_timeout_s=args.request_timeout,
        concurrency_lease_s=args.concurrency_lease,
        control_plane_url=args.control_plane_url or _control_plane_url_from_env(),
        max_file_bytes=args.max_file_bytes,
        control_plane_timeout_s=args.control_plane_timeout,
    )


def advertised(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GatewayServer(uvicorn.Server):
    """uvicorn, with the gateway's held requests answered as its shutdown begins: uvicorn tells an
    application of shutdown only after its graceful timeout, by then having dropped them."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.gateway.stop_holding()
        await super().shutdown(sockets)


def main(args: argparse.Namespace) -> int:
    json_lines = jsonlog.configure(args.log_level)
    settings = settings_from_args(args)
    gateway = Gateway(settings)
    config = uvicorn.Config(gateway, host=args.host, port=args.port, loop="uvloop",
                            http=protocol_class(args.request_read_timeout),
                            lifespan="on", log_level=args.log_level, access_log=False, timeout_keep_alive=30,
                            # The client address is the peer's, as given: the gateway appends it to the
                            # X-Forwarded-For it passes to the control plane.
                            proxy_headers=False,
                            backlog=4096, timeout_graceful_shutdown=5,
                            log_config=None if json_lines else uvicorn.config.LOGGING_CONFIG)
    logger.info("gateway %s on http://%s:%d/v1 (redis %s)", settings.instance, args.host, args.port,
                settings.redis_url)
    GatewayServer(config, gateway).run()
    return 0
