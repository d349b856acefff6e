"""Working one eval run (the task "evals.execute_run"): claim it, find or start the replicas, score
every case, save the totals, and tell the apps above (evals.signals.run_finished).

- The claim is a conditional UPDATE queued -> running: a redelivered task, or one for a run
  cancelled while queued, does nothing.
- The cases are scored on an event loop in a thread of their own, `concurrency` at a time, spread
  over the target's replicas. This thread keeps the database: about every half second it saves the
  cases finished since (in bulk), the progress and the heartbeat, and reads whether a cancel was
  asked for. A cancel lets the cases in flight finish and starts no more; the cases done stay.
- A model+version target, or a reference version no replica of the target's deployment serves,
  runs on a temporary replica started through the local replica driver and stopped when the run
  ends, whatever ends it.
- A run whose worker was killed stops beating; `reap_stale_runs` (beat) fails it, see there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from deployments.choices import ACTIVE_ROLLOUT, Backend, ReplicaState
from deployments.models import Replica
from deployments.replicas.drivers import DriverError
from deployments.replicas.drivers.base import ReplicaSpec
from deployments.replicas.drivers.local import LocalProcessDriver
from deployments.replicas.reconcile import Timings, probe_health
from evals.choices import RunStatus, Scorer, TargetKind
from evals.models import EvalCaseResult, EvalRun
from evals.runs.services import send_finished_on_commit
from evals.scoring.client import Generation, ReplicaClient, ReplicaError
from evals.scoring.scorers import CaseOutcome, score_case, summarise
from registry.checkpoint import CheckpointError, artifact_path
from registry.models import ModelVersion

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.5
# A running run whose heartbeat is older than this has lost its worker (settings may shorten it).
STALE_AFTER_S = 120.0
# After SIGTERM, how long a temporary replica has to exit before it is killed.
STOP_GRACE_S = 10.0
PERCENTILES = (50, 90, 95, 99)


class RunFailed(Exception):
    """The run cannot go on; the message says why, in words, and becomes the run's `error`."""


class RunCancelled(Exception):
    """Someone cancelled the run while it ran."""


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: a replica's URL, the model name it serves, and the priority to send (None for vLLM)."""

    url: str
    model: str
    priority: int | None
    label: str  # for errors: "replica 12 of deployment chat", "the temporary replica of tiny v2"


# -- the claim and the record -----------------------------------------------------------------


def claim(run_id: int) -> bool:
    now = timezone.now()
    return EvalRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING, started_at=now, heartbeat_at=now) == 1


class Recorder:
    """What the runner's thread writes while the cases are scored: case rows, progress, heartbeat; and the
    cancel it reads. `outcomes` is appended to by the scoring thread and read here (list appends are atomic)."""

    def __init__(self, run: EvalRun):
        self.run = run
        self.outcomes: list[CaseOutcome] = []
        self.saved = 0
        self.cancel = threading.Event()

    def beat(self) -> None:
        """Save what is new, beat, and raise RunCancelled at a cancel asked before the scoring started."""
        self.flush()
        if self.cancel.is_set():
            raise RunCancelled

    def flush(self) -> None:
        new = self.outcomes[self.saved:len(self.outcomes)]
        with transaction.atomic():
            if new:
                EvalCaseResult.objects.bulk_create(case_row(self.run, outcome) for outcome in new)
                self.saved += len(new)
            EvalRun.objects.filter(pk=self.run.pk).update(done=self.saved, heartbeat_at=timezone.now())
        if EvalRun.objects.filter(pk=self.run.pk, cancel_requested=True).exists():
            self.cancel.set()


def storable(value):
    """value with NUL characters shown as U+FFFD: a model may well output one, and Postgres text and jsonb
    refuse them."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [storable(item) for item in value]
    return value


def case_row(run: EvalRun, outcome: CaseOutcome) -> EvalCaseResult:
    return EvalCaseResult(
        run=run, index=outcome.index, case_id=outcome.case_id, scorer=outcome.scorer,
        output=storable(outcome.output), score=outcome.score, passed=outcome.passed, reason=storable(outcome.reason),
        detail=storable(outcome.detail), prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens, latency_ms=outcome.latency_ms)


# -- temporary replicas -------------------------------------------------------------------------


def temporary_key(run_id: int, role: str) -> str:
    """The local driver's marker for a run's temporary replica ("target" or "reference"); never a Replica
    row's id, so no reconcile pass takes it for one of its own."""
    return f"eval-run-{run_id}-{role}"


@dataclass
class TemporaryReplica:
    """A replica of one version that only one run uses, with no Replica row: it belongs to no deployment,
    and a row would bring it under the reconcile loop. The local driver needs only these attributes."""

    pk: str
    version: ModelVersion
    engine_args: dict
    identity: dict = field(default_factory=dict)
    log_path: str = ""
    url: str = ""

    @property
    def served_name(self) -> str:
        return f"{self.version.model.name}-v{self.version.number}"

    @property
    def label(self) -> str:
        return f"the temporary replica of {self.version}"

    def endpoint(self, priority: int) -> Endpoint:
        return Endpoint(self.url, self.served_name, priority, self.label)


class TemporaryReplicas:
    """Starts temporary replicas and stops every one it started on close, even after a failure or a cancel."""

    def __init__(self, run: EvalRun, recorder: Recorder, driver=None):
        self.run = run
        self.recorder = recorder
        self.driver = driver or LocalProcessDriver()
        self.started: list[TemporaryReplica] = []

    def __enter__(self) -> TemporaryReplicas:
        return self

    def __exit__(self, *exc) -> None:
        for replica in self.started:
            self.stop(replica)

    def start(self, role: str, version: ModelVersion, engine_args: dict) -> TemporaryReplica:
        replica = TemporaryReplica(temporary_key(self.run.pk, role), version, engine_args)
        try:
            spec = ReplicaSpec(deployment=replica.served_name, version=version.number,
                               model_path=str(artifact_path(version.artifact_uri)), backend=Backend.BUILTIN,
                               engine_args=engine_args)
            started = self.driver.start(replica, spec)
        except (DriverError, CheckpointError) as exc:
            raise RunFailed(f"could not start {replica.label}: {exc}") from exc
        replica.url, replica.identity, replica.log_path = started.url, started.identity, started.log_path
        self.started.append(replica)
        return replica

    def wait_ready(self, replicas: list[TemporaryReplica]) -> None:
        """Until each answers /health, within the reconcile loop's start timeout; a replica that exits
        first fails the run with how it ended."""
        timeout_s = Timings.from_settings().start_timeout_s
        deadline = time.monotonic() + timeout_s
        waiting = list(replicas)
        while waiting:
            for replica in list(waiting):
                if not self.driver.is_alive(replica):
                    raise RunFailed(f"{replica.label} exited while starting: {self.ended(replica)}")
                if probe_health(replica.url, 2):
                    waiting.remove(replica)
            if waiting and time.monotonic() > deadline:
                raise RunFailed(f"{waiting[0].label} was not ready {timeout_s:.0f} s after it started "
                                f"(log: {waiting[0].log_path})")
            self.recorder.beat()
            if waiting:
                time.sleep(FLUSH_EVERY_S)

    def ended(self, replica: TemporaryReplica) -> str:
        tail = self.driver.log_tail(replica, lines=5).strip().splitlines()
        return self.driver.exit_status(replica) + (f"; last log line: {tail[-1][:300]}" if tail else "")

    def died(self, url: str) -> str | None:
        """How the temporary replica at url ended, when it is no longer alive; None otherwise."""
        replica = next((r for r in self.started if r.url == url), None)
        if replica is None or self.driver.is_alive(replica):
            return None
        return f"{replica.label} died: {self.ended(replica)}"

    def stop(self, replica: TemporaryReplica) -> None:
        why = f"eval run {self.run.pk} is over"
        self.driver.stop(replica, grace_s=STOP_GRACE_S, why=why)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.driver.is_alive(replica) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.driver.is_alive(replica):
            self.driver.kill(replica, why=f"{why}; it did not exit {STOP_GRACE_S:.0f} s after SIGTERM")


def stop_orphaned_replicas(run_id: int) -> None:
    """Kill the temporary replicas of a run whose worker died, when they run on this node (found by their
    marker; on another node nothing is found and they stay until stopped there)."""
    driver = LocalProcessDriver()
    for role in ("target", "reference"):
        driver.kill(TemporaryReplica(temporary_key(run_id, role), version=None, engine_args={}),
                    why=f"eval run {run_id} lost its worker")


# -- where the requests go ----------------------------------------------------------------------


def priority_for(run: EvalRun, backend: str) -> int | None:
    """The built-in engine schedules by priority; vLLM reads the field the other way round, so it gets none."""
    return run.priority if backend == Backend.BUILTIN else None


def replica_endpoints(run: EvalRun, replicas: list[Replica]) -> list[Endpoint]:
    deployment = run.deployment
    priority = priority_for(run, deployment.backend)
    return [Endpoint(r.url, deployment.name, priority, f"replica {r.pk} of deployment {deployment.name}")
            for r in replicas]


def ready_replicas(run: EvalRun, version: ModelVersion) -> list[Replica]:
    return list(Replica.objects.filter(deployment_id=run.deployment_id, version=version, state=ReplicaState.READY)
                .order_by("id"))


def target_endpoints(run: EvalRun, temporaries: TemporaryReplicas) -> list[Endpoint]:
    if run.target_kind == TargetKind.VERSION:
        replica = temporaries.start("target", run.model_version, run.engine_args)
        return [replica.endpoint(run.priority)]
    deployment = run.deployment
    if deployment is None or deployment.deleted_at:
        raise RunFailed(f"deployment {run.deployment_name} was deleted")
    if run.target_kind == TargetKind.ROLLOUT:
        rollout = run.rollout
        if rollout is None or rollout.status not in ACTIVE_ROLLOUT:
            status = rollout.status if rollout else "deleted"
            raise RunFailed(f"the rollout is {status}: its candidate no longer serves")
        replicas = list(rollout.replicas.filter(state=ReplicaState.READY).order_by("id"))
        if not replicas:
            raise RunFailed(f"no ready candidate replica of rollout {rollout.pk} on deployment {deployment.name}")
        return replica_endpoints(run, replicas)
    replicas = [r for r in ready_replicas(run, run.model_version) if r.engine_args == run.engine_args]
    if not replicas:
        raise RunFailed(f"no ready replica of deployment {deployment.name} serves {run.model_version} "
                        "with its engine args: none is ready now, or the deployment moved to another version "
                        "since the run was asked for")
    return replica_endpoints(run, replicas)


def reference_endpoints(run: EvalRun, temporaries: TemporaryReplicas) -> list[Endpoint]:
    """Replicas of the reference version the target's deployment already serves, else a temporary one."""
    if run.deployment is not None:
        replicas = ready_replicas(run, run.reference_version)
        if replicas:
            return replica_endpoints(run, replicas)
    replica = temporaries.start("reference", run.reference_version, {})
    return [replica.endpoint(run.priority)]


# -- scoring ------------------------------------------------------------------------------------


class CaseError(Exception):
    def __init__(self, case: dict, endpoint: Endpoint, error: Exception):
        super().__init__(f"case {case['id']!r} on {endpoint.label} ({endpoint.url}): {error}")
        self.endpoint = endpoint


async def score_cases(cases: list[dict], targets: list[Endpoint], references: list[Endpoint],
                      concurrency: int, recorder: Recorder, timeout_s: float) -> None:
    """Reference outputs of the parity cases first, then every case, `concurrency` requests at once,
    case i on replica i mod n; finished outcomes go to recorder.outcomes. A cancel starts no new case."""
    limit = asyncio.Semaphore(concurrency)
    clients = {e.url: ReplicaClient(e.url, e.model, priority=e.priority, timeout_s=timeout_s)
               for e in {*targets, *references}}
    reference_outputs: dict[int, Generation] = {}

    async def guarded(case: dict, endpoint: Endpoint, call):
        async with limit:
            if recorder.cancel.is_set():
                return None
            try:
                return await call(clients[endpoint.url])
            except (ReplicaError, httpx.HTTPError, ValueError, KeyError) as exc:
                raise CaseError(case, endpoint, exc) from exc

    async def reference_of(index: int, case: dict) -> None:
        endpoint = references[index % len(references)]
        reference_outputs[index] = await guarded(case, endpoint, lambda client: client.greedy(case))

    async def scored(index: int, case: dict) -> None:
        endpoint = targets[index % len(targets)]
        outcome = await guarded(case, endpoint, lambda client: score_case(
            client, case, index, reference=reference_outputs.get(index)))
        if outcome is not None:
            recorder.outcomes.append(outcome)

    try:
        parity = [(index, case) for index, case in enumerate(cases) if case["scorer"] == Scorer.PARITY]
        async with asyncio.TaskGroup() as group:
            for index, case in parity:
                group.create_task(reference_of(index, case))
        async with asyncio.TaskGroup() as group:
            for index, case in enumerate(cases):
                group.create_task(scored(index, case))
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    finally:
        for client in clients.values():
            await client.aclose()


def score_in_thread(run: EvalRun, targets: list[Endpoint], references: list[Endpoint], recorder: Recorder,
                    temporaries: TemporaryReplicas) -> None:
    """Run score_cases on a thread while this one flushes every FLUSH_EVERY_S (the ORM stays on this thread)."""
    errors: list[BaseException] = []
    timeout_s = getattr(settings, "INFEROPS_EVAL_REQUEST_TIMEOUT_S", 120.0)

    def work() -> None:
        try:
            asyncio.run(score_cases(run.set_version.items, targets, references, run.concurrency, recorder,
                                    timeout_s))
        except BaseException as exc:  # noqa: BLE001 - handed to the other thread, which decides
            errors.append(exc)

    thread = threading.Thread(target=work, name=f"eval-run-{run.pk}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(FLUSH_EVERY_S)
        recorder.flush()
    if errors:
        error = errors[0]
        if isinstance(error, CaseError):
            died = temporaries.died(error.endpoint.url)
            raise RunFailed(f"{died}; {error}" if died else str(error)) from error
        raise RunFailed(f"scoring failed: {error!r}") from error
    if recorder.cancel.is_set():
        raise RunCancelled


# -- the run --------------------------------------------------------------------------------------


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolated between the nearest ranks (numpy's default,
    without numpy: the worker's image has none)."""
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_percentiles(outcomes: list[CaseOutcome]) -> dict:
    if not outcomes:
        return {}
    ordered = sorted(o.latency_ms for o in outcomes)
    return {f"p{p}": round(percentile(ordered, p), 3) for p in PERCENTILES}


def finish(run: EvalRun, recorder: Recorder, status: str, error: str = "") -> EvalRun:
    """Save the last cases and the totals, and send run_finished after the commit. Scores only for a
    run that scored every case: a partial score must not read as the version's."""
    outcomes = sorted(recorder.outcomes, key=lambda outcome: outcome.index)
    scores, score = summarise(outcomes) if status == RunStatus.SUCCEEDED else ({}, None)
    with transaction.atomic():
        recorder.flush()
        updated = EvalRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(
            status=status, error=error, done=len(outcomes), scores=scores, score=score,
            prompt_tokens=sum(o.prompt_tokens for o in outcomes),
            completion_tokens=sum(o.completion_tokens for o in outcomes),
            latency_ms=latency_percentiles(outcomes), finished_at=timezone.now(), updated_at=timezone.now())
        run = EvalRun.objects.get(pk=run.pk)
        if updated:
            send_finished_on_commit(run)
    return run


def execute_run(run_id: int) -> str:
    """The task's work: the run's final status, or "not queued" when another claim won (or it was cancelled)."""
    if not claim(run_id):
        return "not queued"
    run = (EvalRun.objects.select_related("set_version", "deployment", "rollout", "model_version__model",
                                          "reference_version__model").get(pk=run_id))
    recorder = Recorder(run)
    try:
        with TemporaryReplicas(run, recorder) as temporaries:
            targets = target_endpoints(run, temporaries)
            parity = any(case["scorer"] == Scorer.PARITY for case in run.set_version.items)
            references = reference_endpoints(run, temporaries) if parity and run.reference_version else []
            temporaries.wait_ready(temporaries.started)
            score_in_thread(run, targets, references, recorder, temporaries)
    except RunCancelled:
        run = finish(run, recorder, RunStatus.CANCELLED,
                     f"Cancelled after {len(recorder.outcomes)} of {run.total} cases.")
    except RunFailed as exc:
        run = finish(run, recorder, RunStatus.FAILED, str(exc))
    except Exception as exc:
        log.exception("eval run %s failed", run_id)
        recorder.cancel.set()  # the scoring thread, if still going, starts no more cases
        del recorder.outcomes[recorder.saved:]  # what failed may be saving them: the run must still end
        run = finish(run, recorder, RunStatus.FAILED, f"internal error: {exc!r}")
        raise
    else:
        run = finish(run, recorder, RunStatus.SUCCEEDED)
    return run.status


# -- the reaper -----------------------------------------------------------------------------------


def reap_stale_runs(now=None) -> list[int]:
    """Fail the running runs whose heartbeat stopped (their worker was killed or lost the database), and
    kill their temporary replicas when they run on this node. Returns their ids.

    Failed rather than requeued: what killed the worker may be the run itself (a temporary replica too
    big for the node's memory), and a second attempt would take the next worker down the same way. The
    cases it saved stay; whoever asked (a person, CI, a schedule, a rollout step) starts another run.
    Each run is taken by a conditional UPDATE on the heartbeat it was seen with, so two reapers, or a
    runner that wakes up late, never both finish it.
    """
    now = now or timezone.now()
    stale_after_s = getattr(settings, "INFEROPS_EVAL_STALE_AFTER_S", STALE_AFTER_S)
    cutoff = now - timedelta(seconds=stale_after_s)
    stale = EvalRun.objects.filter(status=RunStatus.RUNNING).filter(
        Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True, started_at__lt=cutoff))
    reaped = []
    for run in stale:
        seen = run.heartbeat_at.isoformat() if run.heartbeat_at else "never"
        with transaction.atomic():
            updated = EvalRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING,
                                             heartbeat_at=run.heartbeat_at).update(
                status=RunStatus.FAILED, finished_at=now, updated_at=now,
                error=(f"The worker running it stopped: no heartbeat for over {stale_after_s:.0f} s (last {seen}). "
                       f"The {run.done} cases it scored are kept; start a new run."))
            if updated:
                send_finished_on_commit(EvalRun.objects.get(pk=run.pk))
        if updated:
            with contextlib.suppress(DriverError, OSError):
                stop_orphaned_replicas(run.pk)
            reaped.append(run.pk)
    return reaped
