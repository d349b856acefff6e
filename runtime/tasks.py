"""Celery tasks of the runtime: thin wrappers that take ids and call one function."""

from celery import shared_task

from deployments.models import Deployment
from runtime import reconcile

# Celery's autodiscovery imports only `tasks` modules; these live beside the code they run.
from runtime.retention import prune_metrics_task, rollup_metrics_task  # noqa: E402,F401
from runtime.scraping import scrape_replicas  # noqa: E402,F401


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
