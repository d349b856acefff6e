"""Notification delivery: claim the rows, make one attempt through the receiver's kind, record it.

A worker claims a notification, with the pending ones of the same group, target, transition and
round, by a conditional UPDATE that marks them with its batch id: they go as one message (a
group's alerts together), and a redelivered Celery task finds nothing left to claim, so it never
sends twice. Each attempt is a `Delivery` row; a
temporary error leaves the notification pending for the task to retry with backoff, a permanent
one fails it and marks the receiver failing until its next success. The alert's timeline says
who was notified, and what could not be.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from alerts.choices import DeliveryOutcome, EventKind, NotificationStatus, ReceiverKind
from alerts.models import AlertEvent, Delivery, Notification, Receiver
from alerts.receivers import kinds as receivers
from alerts.receivers.webhook import DeliveryError

log = logging.getLogger(__name__)

# A notification left "sending" this long belongs to a worker that died mid-send: reclaim it.
STALE_CLAIM = timedelta(minutes=5)


@dataclass(frozen=True)
class DeliveryResult:
    outcome: str  # "sent", "retry", "failed", or "skipped" when another worker holds the rows
    attempt: int = 0
    alerts: int = 0


def _claim(notification_id: int) -> list[Notification]:
    """Claim the notification and its pending siblings (same group, target, transition and round)
    with one conditional UPDATE: they go as one message, and only one worker sends each."""
    lead = Notification.objects.filter(pk=notification_id).values(
        "group_id", "receiver_id", "user_id", "alert_status", "round").first()
    if lead is None:
        return []
    now, batch = timezone.now(), uuid.uuid4()
    claimable = Q(status=NotificationStatus.PENDING) | Q(status=NotificationStatus.SENDING,
                                                          claimed_at__lt=now - STALE_CLAIM)
    siblings = Notification.objects.filter(claimable, **lead)
    if not siblings.update(status=NotificationStatus.SENDING, claimed_at=now, batch=batch):
        return []
    claimed = Notification.objects.filter(batch=batch, status=NotificationStatus.SENDING)
    return list(claimed.select_related("alert", "alert__slo", "receiver", "user", "group__route")
                .order_by("alert__starts_at", "pk"))


def email_receiver_for(user) -> Receiver:
    """A person paged by an escalation step is reached by email, as an email receiver would be."""
    return Receiver(name=f"@{user.username}", kind=ReceiverKind.EMAIL, to=[user.email])


def notification_deliver(*, notification_id: int, max_attempts: int | None = None) -> DeliveryResult:
    """Send a notification and its claimed siblings once (one attempt), recording the attempt."""
    max_attempts = max_attempts or settings.INFEROPS_WEBHOOK_MAX_ATTEMPTS
    batch = _claim(notification_id)
    if not batch:
        return DeliveryResult("skipped")
    first = batch[0]
    receiver = first.receiver or email_receiver_for(first.user)
    alerts, announced = [n.alert for n in batch], first.alert_status
    attempt = max(n.attempts for n in batch) + 1
    outcome, http_status, error = DeliveryOutcome.OK, None, ""
    started = time.perf_counter()
    try:
        http_status = receivers.send(alerts, receiver, announced, group=first.group)
    except DeliveryError as exc:
        http_status, error = exc.http_status, str(exc)
        outcome = DeliveryOutcome.PERMANENT_ERROR if exc.permanent else DeliveryOutcome.TEMPORARY_ERROR
    duration_ms = (time.perf_counter() - started) * 1000
    if outcome == DeliveryOutcome.OK:
        status, result = NotificationStatus.SENT, "sent"
    elif outcome == DeliveryOutcome.TEMPORARY_ERROR and attempt < max_attempts:
        status, result = NotificationStatus.PENDING, "retry"
    else:
        status, result = NotificationStatus.FAILED, "failed"
    now = timezone.now()
    with transaction.atomic():
        Delivery.objects.bulk_create([
            Delivery(notification=n, attempt=attempt, outcome=outcome, http_status=http_status, error=error[:2000],
                     duration_ms=duration_ms) for n in batch], ignore_conflicts=True)
        Notification.objects.filter(pk__in=[n.pk for n in batch]).update(
            status=status, attempts=attempt,
            finished_at=now if status in (NotificationStatus.SENT, NotificationStatus.FAILED) else None,
        )
        together = f" with {len(batch) - 1} other alert{'s' if len(batch) > 2 else ''}" if len(batch) > 1 else ""
        if result == "sent":
            if first.receiver_id:
                Receiver.objects.filter(pk=receiver.pk, failing_since__isnull=False).update(failing_since=None,
                                                                                            last_error="")
            AlertEvent.objects.bulk_create([
                _event(n, EventKind.NOTIFIED, now, receiver, attempt,
                       f"{announced} sent to {receiver.name} ({receiver.kind}){together}") for n in batch])
        elif result == "failed":
            if outcome == DeliveryOutcome.PERMANENT_ERROR and first.receiver_id:
                Receiver.objects.filter(pk=receiver.pk).update(
                    failing_since=Coalesce("failing_since", Value(now)), last_error=error[:2000])
            AlertEvent.objects.bulk_create([
                _event(n, EventKind.NOTIFY_FAILED, now, receiver, attempt,
                       f"{announced} to {receiver.name} ({receiver.kind}) failed after {attempt} "
                       f"attempt{'s' if attempt > 1 else ''}: {error[:300]}", error=error[:500]) for n in batch])
    if result == "failed":
        log.warning("notification %s (%d alerts) to %s failed after %d attempts: %s", first.pk, len(batch),
                    receiver.name, attempt, error)
    return DeliveryResult(result, attempt, len(batch))


def _event(notification: Notification, kind: str, now, receiver: Receiver, attempt: int, text: str,
           **extra) -> AlertEvent:
    data = {"receiver": receiver.name, "kind": receiver.kind, "alert_status": notification.alert_status,
            "notification": notification.pk, "attempt": attempt, "round": notification.round, **extra}
    return AlertEvent(alert=notification.alert, kind=kind, at=now, text=text, data=data)
