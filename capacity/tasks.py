"""Celery tasks of elastic capacity: thin wrappers that take ids and call one function."""

import time

from celery import shared_task

from capacity import scaling
from deployments.replicas.reconcile import Timings


@shared_task(name="capacity.autoscale_all", ignore_result=True)
def autoscale_all() -> int:
    """Beat (every INFEROPS_AUTOSCALE_INTERVAL_S): one autoscaling tick per autoscaled deployment."""
    return scaling.autoscale_all()


@shared_task(name="capacity.wake_requested", ignore_result=True)
def wake_requested() -> list[int]:
    """Beat (every INFEROPS_WAKE_POLL_S): wake the parked deployments gateways hold requests for."""
    return scaling.wake_requested()


# Between a waking deployment's reconcile passes; it gives up after the reconcile loop's start timeout
# (the beat's passes carry on from there).
WAKE_PASS_S = 0.25


@shared_task(name="capacity.wake_deployment", ignore_result=True)
def wake_deployment(deployment_id: int, until: float | None = None) -> str:
    until = until or time.time() + Timings.from_settings().start_timeout_s
    outcome = scaling.wake(deployment_id)
    if outcome == "starting" and time.time() < until:
        wake_deployment.apply_async((deployment_id, until), countdown=WAKE_PASS_S, expires=until)
    elif outcome == "ready":
        record_first_token.apply_async((deployment_id, time.time() + FIRST_TOKEN_WAIT_S), countdown=1)
    return outcome


# How long after a wake the first token is looked for on the woken replica's /metrics (the scrape
# finds it later too): the held requests go the moment the routing table lists the replica.
FIRST_TOKEN_WAIT_S = 30


@shared_task(name="capacity.record_first_token", ignore_result=True)
def record_first_token(deployment_id: int, until: float) -> bool:
    """Record the woken replica's cold start, phase by phase, once its first token is out."""
    recorded = scaling.record_woken_start(deployment_id)
    if not recorded and time.time() < until:
        record_first_token.apply_async((deployment_id, until), countdown=1, expires=until)
    return recorded


@shared_task(name="capacity.execute_capacity_run", ignore_result=True)
def execute_capacity_run(run_id: int) -> str:
    """A capacity run's steps against one replica, its curve stored (enqueued by capacity.runs.capacity_run_create)."""
    from capacity import runs

    return runs.capacity_run_execute(run_id)
