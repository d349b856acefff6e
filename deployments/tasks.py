"""Celery tasks of deployments and their replicas: thin wrappers that take ids and call one function."""

from celery import shared_task

from deployments.models import Deployment
from deployments.replicas import reconcile, retention, scraping
from deployments.services import RECONCILE_TASK_EXPIRES_S


@shared_task(name="deployments.reconcile_all", ignore_result=True)
def reconcile_all() -> int:
    """Beat fans out one reconcile per deployment; each takes its own lock."""
    ids = list(Deployment.objects.values_list("pk", flat=True))
    for deployment_id in ids:
        reconcile_deployment.delay(deployment_id)
    return len(ids)


@shared_task(name="deployments.reconcile_deployment", ignore_result=True, expires=RECONCILE_TASK_EXPIRES_S)
def reconcile_deployment(deployment_id: int) -> str:
    return reconcile.reconcile_deployment(deployment_id)


@shared_task(name="deployments.scrape_replicas")
def scrape_replicas() -> dict:
    """Beat task (every 15 s): one scrape cycle over all ready replicas."""
    return scraping.scrape_cycle().as_dict()


@shared_task(name="deployments.rollup_metrics")
def rollup_metrics() -> dict:
    """Beat task (every 5 minutes): recompute the recent hours' roll-ups."""
    return retention.rollup_metrics()


@shared_task(name="deployments.prune_metrics")
def prune_metrics() -> dict:
    """Beat task (hourly): drop rows past retention."""
    return retention.prune_metrics()
