"""Celery tasks of elastic capacity: thin wrappers that take ids and call one function."""

from celery import shared_task

from capacity import scaling


@shared_task(name="capacity.autoscale_all", ignore_result=True)
def autoscale_all() -> int:
    """Beat (every INFEROPS_AUTOSCALE_INTERVAL_S): one autoscaling tick per autoscaled deployment."""
    return scaling.autoscale_all()


@shared_task(name="capacity.wake_requested", ignore_result=True)
def wake_requested() -> list[int]:
    """Beat (every INFEROPS_WAKE_POLL_S): wake the parked deployments gateways hold requests for."""
    return scaling.wake_requested()


@shared_task(name="capacity.wake_deployment", ignore_result=True, expires=60)
def wake_deployment(deployment_id: int) -> str:
    return scaling.wake(deployment_id)
