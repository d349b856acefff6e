"""Capacity runs: a short stepped-rate benchmark against one ready replica of a deployment, stored as a
goodput curve for the planner.

The requests go to the replica's own URL, not through a gateway, so they count in no tenant's usage
and no SLO; a built-in replica runs them at the lowest priority (its background class), so live
traffic it serves meanwhile goes first, and the curve then measures what is left, not the replica's
whole capacity (the panel and docs say so). Goodput is counted against the deployment's TTFT and TPOT
targets (slo.engine_targets), so the planner can judge the curve on them.

One run at a time per deployment. A run is a row: `capacity_run_create` checks and queues it (the
deployment row locked, so two requests cannot both pass the check), the task "capacity.execute_capacity_run"
claims it with a conditional UPDATE and runs `capacity_run_execute`. A run whose worker died is failed by
the next request for a run once it is past any time it could still take, so it never blocks for good.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from capacity.choices import ACTIVE_RUN, CurveSource, RunStatus
from capacity.curves import curve_create, deployment_hardware
from capacity.models import CapacityRun
from deployments.choices import Backend, ReplicaState
from deployments.models import Deployment, Replica
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.celery import enqueue
from slo.engine_targets import deployment_targets

if TYPE_CHECKING:
    from runtime.loadgen import BenchConfig

log = logging.getLogger(__name__)

EXECUTE_TASK = "capacity.execute_capacity_run"
DEFAULT_RATES = (0.5, 1.0, 2.0, 4.0, 8.0)
DEFAULT_STEP_S = 20.0
MAX_STEPS = 10
STEP_S_RANGE = (5.0, 120.0)
MAX_RATE = 200.0
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 128, 64
LOWEST_PRIORITY = -1000  # the built-in engine's background priority, as offline batches send
# A queued run no worker took within this long, or a running one this far past its longest possible
# end, is failed when the next run is asked for.
QUEUED_STALE_AFTER = timedelta(minutes=30)
RUNNING_GRACE = timedelta(minutes=5)


def request_timeout_s(step_s: float) -> float:
    # A request with no answer for a step's length is past any capacity worth planning on: counted as
    # failed, it also bounds how long an overloaded step can take to drain.
    return max(10.0, step_s)


def longest_duration(run: CapacityRun) -> timedelta:
    """The most a run can take: each step's arrivals, then its last request's time-out."""
    return timedelta(seconds=len(run.rates) * (run.step_s + request_timeout_s(run.step_s)))


def estimated_finish(run: CapacityRun):
    """When a running run should end (its steps' arrivals, each drained quickly); None before it starts."""
    if run.started_at is None:
        return None
    return run.started_at + timedelta(seconds=len(run.rates) * (run.step_s + 1))


def ready_replica(deployment: Deployment) -> Replica | None:
    """The replica a run measures: the oldest ready one of the deployment's version at its engine
    arguments (not a rollout's candidate), so the curve is of what the deployment is."""
    replicas = Replica.objects.filter(deployment=deployment, state=ReplicaState.READY, version_id=deployment.version_id,
                                      rollout__isnull=True).exclude(url="").order_by("ready_at", "id")
    return next((replica for replica in replicas if replica.engine_args == deployment.engine_args), None)


def stale_reason(run: CapacityRun, now) -> str | None:
    """Why an active run can no longer be going on (its worker died, or none took it); None if it can."""
    if run.status == RunStatus.QUEUED and run.created_at + QUEUED_STALE_AFTER < now:
        return f"no worker took it within {int(QUEUED_STALE_AFTER.total_seconds() // 60)} minutes"
    if (run.status == RunStatus.RUNNING and run.started_at is not None
            and run.started_at + longest_duration(run) + RUNNING_GRACE < now):
        return "its worker stopped before it finished"
    return None


def fail_stale_runs(deployment: Deployment, now) -> int:
    failed = 0
    for run in CapacityRun.objects.filter(deployment=deployment, status__in=ACTIVE_RUN):
        if why := stale_reason(run, now):
            failed += CapacityRun.objects.filter(pk=run.pk, status=run.status).update(
                status=RunStatus.FAILED, error=why, finished_at=now)
    return failed


def capacity_run_create(*, deployment: Deployment, actor, rates: list[float], step_s: float, input_len: int,
                        output_len: int) -> CapacityRun:
    """Queue a run (its fields already validated); Conflict (409) while another is active or no replica is ready."""
    now = timezone.now()
    with transaction.atomic():
        Deployment.objects.select_for_update().get(pk=deployment.pk)
        fail_stale_runs(deployment, now)
        active = CapacityRun.objects.filter(deployment=deployment, status__in=ACTIVE_RUN).first()
        if active is not None:
            raise Conflict(f"Capacity run {active.pk} of {deployment.name} is {active.status} (asked for at "
                             f"{active.created_at:%Y-%m-%d %H:%M:%S} UTC): one run at a time per deployment, "
                             "as two would measure each other.")
        if ready_replica(deployment) is None:
            raise Conflict(f"No ready replica of {deployment.name} serves its version "
                             f"v{deployment.version.number} at its engine arguments: a capacity run measures one. "
                             "Wait until one is ready.")
        run = CapacityRun.objects.create(deployment=deployment, rates=list(rates), step_s=step_s,
                                         input_len=input_len, output_len=output_len, created_by=actor_or_none(actor))
        audit_record(actor=actor, action="capacity.run.create", obj=run, after=snapshot(run))
        transaction.on_commit(lambda: enqueue(EXECUTE_TASK, run.pk))
    return run


def _claim(run_id: int) -> CapacityRun | None:
    claimed = CapacityRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING, started_at=timezone.now())
    return CapacityRun.objects.select_related("deployment__version", "created_by").get(pk=run_id) if claimed else None


def _finish(run: CapacityRun, status: str, error: str = "", curve=None) -> None:
    run.status, run.error, run.curve, run.finished_at = status, error, curve, timezone.now()
    # Only a run still running: one failed meanwhile as stale stays failed.
    CapacityRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(
        status=status, error=error, curve=curve, finished_at=run.finished_at)


def bench_config(run: CapacityRun, replica: Replica, goodput_slos_ms: dict[str, float]) -> BenchConfig:
    from runtime.loadgen import BenchConfig, LengthRange  # the worker's image has it; the web image need not

    deployment = run.deployment
    tokenizer = Path(deployment.version.artifact_uri)
    return BenchConfig(
        base_url=replica.url, model=deployment.name, endpoint="completions",
        input_len=LengthRange(run.input_len, run.input_len), output_len=LengthRange(run.output_len, run.output_len),
        goodput_slos_ms=goodput_slos_ms, seed=run.pk,
        priority=LOWEST_PRIORITY if deployment.backend == Backend.BUILTIN else None,
        timeout_s=request_timeout_s(run.step_s), show_progress=False,
        # Exact prompt lengths where the checkpoint's tokenizer is on this machine; words (about a token each) if not.
        tokenizer_dir=str(tokenizer) if (tokenizer / "tokenizer.json").is_file() else None)


def capacity_run_execute(run_id: int) -> str:
    from runtime.loadgen import BenchConfigError, run_curve

    """Run one queued run to its end: its steps against one ready replica, then its curve stored."""
    run = _claim(run_id)
    if run is None:
        return "not queued"
    deployment = run.deployment
    replica = ready_replica(deployment)
    if replica is None:
        _finish(run, RunStatus.FAILED, f"no ready replica of {deployment.name} at its version and engine arguments")
        return "failed"
    targets = deployment_targets(deployment)
    slos = {name: targets[f"{name}_ms"] for name in ("ttft", "tpot") if targets[f"{name}_ms"] is not None}
    try:
        points = run_curve(bench_config(run, replica, slos), list(run.rates), run.step_s)
    except Exception as exc:  # the row must say so, or it would read as running until it goes stale
        log.exception("capacity run %s against %s failed", run.pk, replica.url)
        _finish(run, RunStatus.FAILED, f"the benchmark against replica {replica.pk} ({replica.url}) failed: "
                                       f"{exc.__class__.__name__}: {exc}")
        if isinstance(exc, BenchConfigError | OSError):
            return "failed"
        raise
    if not any(point["completed"] for point in points):
        _finish(run, RunStatus.FAILED, f"replica {replica.pk} ({replica.url}) completed no request in any step")
        return "failed"
    curve = curve_create(version=replica.version, hardware=deployment_hardware(deployment),
                         engine_args=replica.engine_args, deployment=deployment.name, source=CurveSource.CAPACITY_RUN,
                         input_len=run.input_len, output_len=run.output_len, slo_ms=slos, points=points,
                         actor=run.created_by)
    _finish(run, RunStatus.SUCCEEDED, curve=curve)
    log.info("capacity run %s of %s: curve %s over %s req/s", run.pk, deployment.name, curve.pk, run.rates)
    return "succeeded"
