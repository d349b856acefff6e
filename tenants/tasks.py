"""Celery tasks of the tenants app: thin wrappers around publish and ingest."""

from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone
from redis.exceptions import LockError

from inferops.redis_client import redis_client
from tenants import ingest
from tenants.models import UsageEvent
from tenants.publish import publish_keys


@shared_task(name="tenants.publish_keys", ignore_result=True)
def publish_keys_task() -> int:
    """Beat (every 30 s): republish the whole key table, so a flushed or restarted Redis heals."""
    return publish_keys()


@shared_task(name="tenants.ingest_usage", ignore_result=True)
def ingest_usage_task() -> dict | None:
    """Beat (every 2 s): drain the usage stream for up to the ingest budget.

    One run per host at a time: beat fires every 2 s while a run with backlog lasts longer, and
    stacking them would take every worker slot from other tasks. Other hosts consume in parallel
    (the consumer group hands each its own entries).
    """
    budget_s = settings.INFEROPS_USAGE_INGEST_BUDGET_S
    lock = redis_client().lock(f"{ingest.STREAM_KEY}:lock:{socket.gethostname()}", timeout=budget_s + 60)
    if not lock.acquire(blocking=False):
        return None
    try:
        return dataclasses.asdict(ingest.ingest_usage(budget_s=budget_s))
    finally:
        try:
            lock.release()
        except LockError:
            pass  # expired while a very slow run went on; nothing to release


def prune_usage_events(*, now=None) -> int:
    """Delete raw events older than INFEROPS_USAGE_EVENT_RETENTION_DAYS; the minute ledger stays."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.INFEROPS_USAGE_EVENT_RETENTION_DAYS)
    deleted, _ = UsageEvent.objects.filter(time__lt=cutoff).delete()
    return deleted


@shared_task(name="tenants.prune_usage_events", ignore_result=True)
def prune_usage_events_task() -> int:
    """Beat (hourly): raw events past retention, and consumer names of long-gone workers."""
    ingest.forget_idle_consumers(redis_client())
    return prune_usage_events()
