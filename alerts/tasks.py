"""Celery tasks of the alerts app: thin wrappers around notification delivery."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from alerts.services import notification_deliver


@shared_task(name="alerts.deliver_notification", bind=True, ignore_result=True, max_retries=None)
def deliver_notification(self, notification_id: int) -> str:
    """One HTTP attempt; a temporary error re-queues the task with exponential backoff (the
    attempt cap lives in the row, INFEROPS_WEBHOOK_MAX_ATTEMPTS)."""
    result = notification_deliver(notification_id=notification_id)
    if result.outcome == "retry":
        countdown = settings.INFEROPS_WEBHOOK_BACKOFF_S * 2 ** (result.attempt - 1)
        raise self.retry(countdown=min(countdown, 3600))
    return result.outcome
