"""Alert lifecycle from SLO evaluations, and notification delivery.

An SLO has at most one firing alert per severity. It opens when any rule of that severity holds
(burn rate at or above the factor over both its long and its short window, with enough traffic
in the long window), is updated while one holds, and resolves when none holds any more, which
in practice is when the short window recovers: the short window is there so a fixed problem
stops paging within minutes rather than after the long window drains.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from alerts import webhook
from alerts.choices import AlertStatus, DeliveryOutcome, NotificationStatus, Severity
from alerts.models import Alert, Delivery, Notification, Receiver, fingerprint_of
from registry.services import audit_record, snapshot

log = logging.getLogger(__name__)

ALERT_NAME = "SloErrorBudgetBurn"
# A notification left "sending" this long belongs to a worker that died mid-send: reclaim it.
STALE_CLAIM = timedelta(minutes=5)


@dataclass
class AlertChanges:
    opened: int = 0
    updated: int = 0
    resolved: int = 0
    firing_slo_ids: set[int] = field(default_factory=set)


def alert_labels(slo, severity: str) -> dict[str, str]:
    labels = {"alertname": ALERT_NAME, "slo": slo.name, "severity": severity, "sli": slo.sli_kind,
              "window": slo.window, "scope": slo.scope}
    if slo.deployment_id:
        labels["deployment"] = slo.deployment.name
    if slo.model_id:
        labels["model"] = slo.model.name
    if slo.tenant:
        labels["tenant"] = slo.tenant
    return labels


def _minutes(n: int) -> str:
    return f"{n // 60}h" if n % 60 == 0 and n >= 60 else f"{n}m"


def alert_annotations(slo, evaluation, severity: str) -> dict[str, str]:
    holding = evaluation.firing(severity)
    verdict = max(holding, key=lambda v: v.short_burn) if holding else None
    remaining = evaluation.budget.budget_remaining
    description = (
        f"{slo.sli_kind} SLO {slo.name} (objective {slo.objective:.4%}, {slo.window} window): "
        f"{remaining:.1%} of the error budget left."
    )
    if verdict:
        rule = verdict.rule
        description += (
            f" Burn rate {verdict.long_burn:.1f}x over {_minutes(rule.long_minutes)} and "
            f"{verdict.short_burn:.1f}x over {_minutes(rule.short_minutes)} (threshold {rule.factor:g}x, "
            f"{verdict.long_events} events in the long window)."
        )
    return {
        "summary": f"SLO {slo.name} is burning its error budget too fast ({severity})",
        "description": description,
        "runbook_url": slo.runbook_url,
        "burn_rate_1h": f"{evaluation.burn_rates['1h']:.3f}",
        "budget_remaining": f"{remaining:.4f}",
        "rule": verdict.rule.name if verdict else "",
    }


def _enqueue_notifications(alert: Alert, status: str) -> None:
    receivers = Receiver.objects.filter(active=True)
    if status == AlertStatus.RESOLVED:
        receivers = receivers.filter(send_resolved=True)
    for receiver in receivers:
        notification, created = Notification.objects.get_or_create(alert=alert, receiver=receiver, alert_status=status)
        if created:
            transaction.on_commit(lambda pk=notification.pk: _send_later(pk))


def _send_later(notification_id: int) -> None:
    from alerts.tasks import deliver_notification

    deliver_notification.delay(notification_id)


def alerts_sync(*, pairs: list, now: datetime) -> AlertChanges:
    """Open, update or resolve the alerts of each (slo, evaluation) pair."""
    changes = AlertChanges()
    still_firing: list[Alert] = []
    firing = {(a.slo_id, a.severity): a for a in Alert.objects.filter(
        status=AlertStatus.FIRING, slo_id__in=[slo.pk for slo, _ in pairs])}
    for slo, evaluation in pairs:
        for severity in Severity.values:
            current = firing.get((slo.pk, severity))
            holds = bool(evaluation.firing(severity))
            if holds:
                changes.firing_slo_ids.add(slo.pk)
            if holds and current is None:
                alert_open(slo=slo, severity=severity, evaluation=evaluation, now=now)
                changes.opened += 1
            elif holds:
                current.annotations = alert_annotations(slo, evaluation, severity)
                current.updated_at = timezone.now()
                still_firing.append(current)
            elif current is not None:
                alert_resolve(alert=current, now=now, annotations=alert_annotations(slo, evaluation, severity))
                changes.resolved += 1
    changes.updated = Alert.objects.bulk_update(still_firing, ["annotations", "updated_at"], batch_size=500)
    # An SLO deleted along with its deployment leaves its firing alerts without a source: end them.
    for orphan in Alert.objects.filter(status=AlertStatus.FIRING, slo__isnull=True, labels__alertname=ALERT_NAME):
        alert_resolve(alert=orphan, now=now)
        changes.resolved += 1
    return changes


def alert_open(*, slo, severity: str, evaluation, now: datetime) -> Alert:
    labels = alert_labels(slo, severity)
    with transaction.atomic():
        alert = Alert.objects.create(
            fingerprint=fingerprint_of(labels), labels=labels, severity=severity, status=AlertStatus.FIRING,
            annotations=alert_annotations(slo, evaluation, severity), starts_at=now, slo=slo,
        )
        audit_record(actor=None, action="alert.open", obj=alert, after=snapshot(alert))
        _enqueue_notifications(alert, AlertStatus.FIRING)
    log.warning("alert opened: %s", alert)
    return alert


def alert_raise(*, labels: dict[str, str], annotations: dict[str, str], severity: str, now: datetime) -> Alert:
    """An alert not tied to an SLO (e.g. an aborted rollout); one firing row per label set."""
    fingerprint = fingerprint_of(labels)
    with transaction.atomic():
        alert = Alert.objects.select_for_update().filter(fingerprint=fingerprint, status=AlertStatus.FIRING).first()
        if alert is not None:
            alert.annotations = annotations
            alert.save(update_fields=["annotations", "updated_at"])
            return alert
        alert = Alert.objects.create(fingerprint=fingerprint, labels=labels, severity=severity,
                                     status=AlertStatus.FIRING, annotations=annotations, starts_at=now)
        audit_record(actor=None, action="alert.open", obj=alert, after=snapshot(alert))
        _enqueue_notifications(alert, AlertStatus.FIRING)
    log.warning("alert opened: %s", alert)
    return alert


def alert_resolve(*, alert: Alert, now: datetime, annotations: dict | None = None) -> Alert:
    with transaction.atomic():
        changed = Alert.objects.filter(pk=alert.pk, status=AlertStatus.FIRING).update(
            status=AlertStatus.RESOLVED, ends_at=now, annotations=annotations or alert.annotations,
            updated_at=timezone.now(),
        )
        if changed:
            alert.refresh_from_db()
            audit_record(actor=None, action="alert.resolve", obj=alert, after=snapshot(alert))
            _enqueue_notifications(alert, AlertStatus.RESOLVED)
    return alert


# ---------------------------------------------------------------------------- delivery


@dataclass(frozen=True)
class DeliveryResult:
    outcome: str  # "sent", "retry", "failed", or "skipped" when another worker holds the row
    attempt: int = 0


def _claim(notification_id: int) -> Notification | None:
    """Conditional UPDATE: only one worker proceeds, so a redelivered task never sends twice."""
    now = timezone.now()
    claimable = Q(status=NotificationStatus.PENDING) | Q(status=NotificationStatus.SENDING,
                                                          claimed_at__lt=now - STALE_CLAIM)
    if Notification.objects.filter(claimable, pk=notification_id).update(
            status=NotificationStatus.SENDING, claimed_at=now) != 1:
        return None
    return Notification.objects.select_related("alert", "alert__slo", "receiver").get(pk=notification_id)


def notification_deliver(*, notification_id: int, max_attempts: int | None = None) -> DeliveryResult:
    """Send one notification once (one HTTP attempt), recording the attempt."""
    max_attempts = max_attempts or settings.INFEROPS_WEBHOOK_MAX_ATTEMPTS
    notification = _claim(notification_id)
    if notification is None:
        return DeliveryResult("skipped")
    attempt = notification.attempts + 1
    payload = webhook.alertmanager_payload(
        alerts=[notification.alert], receiver=notification.receiver.name, status=notification.alert_status,
        external_url=settings.INFEROPS_EXTERNAL_URL,
    )
    outcome, http_status, error, duration_ms = DeliveryOutcome.OK, None, "", 0.0
    try:
        http_status, duration_ms = webhook.notify(notification.receiver.url, payload,
                                                  timeout_s=settings.INFEROPS_WEBHOOK_TIMEOUT_S)
    except webhook.WebhookError as exc:
        http_status, error, duration_ms = exc.http_status, str(exc), exc.duration_ms
        outcome = DeliveryOutcome.PERMANENT_ERROR if exc.permanent else DeliveryOutcome.TEMPORARY_ERROR
    if outcome == DeliveryOutcome.OK:
        status, result = NotificationStatus.SENT, "sent"
    elif outcome == DeliveryOutcome.TEMPORARY_ERROR and attempt < max_attempts:
        status, result = NotificationStatus.PENDING, "retry"
    else:
        status, result = NotificationStatus.FAILED, "failed"
    with transaction.atomic():
        Delivery.objects.create(notification=notification, attempt=attempt, outcome=outcome, http_status=http_status,
                                error=error[:2000], duration_ms=duration_ms)
        Notification.objects.filter(pk=notification.pk).update(
            status=status, attempts=attempt,
            finished_at=timezone.now() if status in (NotificationStatus.SENT, NotificationStatus.FAILED) else None,
        )
    if result == "failed":
        log.warning("notification %s to %s failed after %d attempts: %s", notification.pk,
                    notification.receiver.name, attempt, error)
    return DeliveryResult(result, attempt)
