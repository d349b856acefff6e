"""Celery tasks of the alerts app: thin wrappers around notification delivery."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from alerts.receivers.delivery import notification_deliver
from alerts.routing.dispatch import groups_advance, groups_notify_waiting
from alerts.services import notify_unmuted


@shared_task(name="alerts.deliver_notification", bind=True, ignore_result=True, max_retries=None)
def deliver_notification(self, notification_id: int) -> str:
    """One attempt; a temporary error re-queues the task with exponential backoff (the
    attempt cap lives in the row, INFEROPS_WEBHOOK_MAX_ATTEMPTS)."""
    result = notification_deliver(notification_id=notification_id)
    if result.outcome == "retry":
        countdown = settings.INFEROPS_WEBHOOK_BACKOFF_S * 2 ** (result.attempt - 1)
        raise self.retry(countdown=min(countdown, 3600))
    return result.outcome


@shared_task(name="alerts.notify_unmuted", ignore_result=True)
def notify_unmuted_task() -> int:
    """Beat (every 30 s): alerts whose silence, snooze or inhibiting page is over notify now."""
    return notify_unmuted()


@shared_task(name="alerts.advance_groups", ignore_result=True)
def advance_groups_task() -> dict:
    """Beat (every INFEROPS_ALERT_TICK_S): notify groups whose wait is over, escalate and repeat."""
    return groups_advance()


@shared_task(name="alerts.notify_waiting_groups", ignore_result=True)
def notify_waiting_groups_task() -> int:
    """After a receiver appears: groups that notified no one for want of a target notify now."""
    return groups_notify_waiting()
