"""Celery tasks of the runtime: thin wrappers that take ids and call one function."""

from celery import shared_task

from deployments.models import Deployment
from runtime import reconcile


@shared_task(name="runtime.reconcile_all", ignore_result=True)
def reconcile_all() -> int:
    """Beat fans out one reconcile per deployment; each takes its own lock."""
    ids = list(Deployment.objects.values_list("pk", flat=True))
    for deployment_id in ids:
        reconcile_deployment.delay(deployment_id)
    return len(ids)


@shared_task(name="runtime.reconcile_deployment", ignore_result=True, expires=30)
def reconcile_deployment(deployment_id: int) -> str:
    return reconcile.reconcile_deployment(deployment_id)
