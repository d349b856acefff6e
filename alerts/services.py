"""Alert lifecycle from SLO evaluations, people acting on alerts, and receivers (delivery lives in
alerts/receivers/delivery.py).

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
from django.core import signing
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone

from alerts.choices import (
    OPEN_STATUSES,
    AlertStatus,
    EventKind,
    IncidentPer,
    NotificationStatus,
    ReceiverKind,
    Severity,
)
from alerts.models import Alert, AlertEvent, AlertGroup, Notification, Receiver, fingerprint_of
from alerts.routing import dispatch as routing
from alerts.silences.muting import muting_reason
from alerts.timeline import record_event
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.celery import enqueue

log = logging.getLogger(__name__)

ALERT_NAME = "SloErrorBudgetBurn"
# A quality SLO pages on its latest eval run's score, not on a burn rate (slo/quality.py).
QUALITY_ALERT_NAME = "SloQualityBelowFloor"
SLO_ALERT_NAMES = (ALERT_NAME, QUALITY_ALERT_NAME)
ACK_SALT = "inferops.alerts.ack"


@dataclass
class AlertChanges:
    opened: int = 0
    updated: int = 0
    resolved: int = 0
    firing_slo_ids: set[int] = field(default_factory=set)


def alert_labels(slo, severity: str) -> dict[str, str]:
    alertname = QUALITY_ALERT_NAME if slo.sli_kind == "quality" else ALERT_NAME
    labels = {"alertname": alertname, "slo": slo.name, "severity": severity, "sli": slo.sli_kind,
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
    if evaluation.quality is not None:  # judged on its latest eval run, which words the alert
        return {**evaluation.quality.annotations(slo), "runbook_url": slo.runbook_url}
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


# Receiver kinds told of an acknowledgement, so the people paged know someone has it (an
# Alertmanager webhook payload has no such event).
ACK_KINDS = (ReceiverKind.PAGERDUTY, ReceiverKind.SLACK, ReceiverKind.EMAIL)


def _enqueue_notifications(alert: Alert, status: str, now: datetime | None = None) -> None:
    """An opening joins the alert to its routes' groups, which notify their targets (at once or
    after group_wait, see alerts/routing/dispatch.py); a muted alert joins them too, and notifies no one
    until the mute ends. An acknowledgement or a resolution goes at once to every target the
    firing reached (people paged by email included), so each hears the end of what it was told;
    a PagerDuty receiver with one incident per group hears of the group (_tell_group_incident)."""
    now = now or timezone.now()
    if status == AlertStatus.FIRING:
        if reason := muting_reason(alert, now):
            record_event(alert, EventKind.MUTED, text=reason, at=now)
        routing.alert_route(alert, now)
        return
    if status == AlertStatus.RESOLVED:
        routing.alert_closed(alert)
    told = (Notification.objects.filter(alert=alert, alert_status=AlertStatus.FIRING)
            .filter(Q(receiver__isnull=True) | Q(receiver__active=True)).select_related("receiver")
            .order_by("round", "pk"))
    if status == AlertStatus.RESOLVED:
        told = told.exclude(receiver__send_resolved=False)
    else:
        told = told.filter(Q(receiver__isnull=True) | Q(receiver__kind__in=ACK_KINDS))
    targets, incidents = {}, set()
    for firing in told:
        if firing.group_id and firing.receiver_id and firing.receiver.kind == ReceiverKind.PAGERDUTY \
                and firing.receiver.incident_per == IncidentPer.GROUP:
            incidents.add((firing.group_id, firing.receiver_id))
        else:
            targets.setdefault((firing.receiver_id, firing.user_id), firing.group_id)
    for group_id, receiver_id in sorted(incidents):  # in one order, as the group rows get locked
        _tell_group_incident(alert, status, group_id, receiver_id)
    for (receiver_id, user_id), group_id in targets.items():
        notification, created = Notification.objects.get_or_create(
            alert=alert, receiver_id=receiver_id, user_id=user_id, alert_status=status, round=0,
            defaults={"group_id": group_id})
        if created:
            transaction.on_commit(lambda pk=notification.pk: enqueue("alerts.deliver_notification", pk))


def _tell_group_incident(alert: Alert, status: str, group_id: int, receiver_id: int) -> None:
    """The group's incident is acknowledged once (acking any alert of the group acknowledges it)
    and resolved once no alert of the group is open, all its alerts in that one message. The
    group row's lock orders the acknowledgements and resolutions of its alerts: the last of two
    resolving at once sees the other resolved."""
    group = AlertGroup.objects.select_for_update().get(pk=group_id)
    of_incident = Notification.objects.filter(group=group, receiver_id=receiver_id)
    if status == AlertStatus.ACKNOWLEDGED:
        if (of_incident.filter(alert_status=AlertStatus.ACKNOWLEDGED, alert__status__in=OPEN_STATUSES)
                .exclude(alert=alert).exists()):
            return  # acknowledged already in this episode
        alert_ids = {alert.pk}
    else:
        if group.alerts.filter(status__in=OPEN_STATUSES).exists():
            return  # the incident stays open while an alert of the group does
        alert_ids = set(of_incident.filter(alert_status=AlertStatus.FIRING).values_list("alert_id", flat=True))
        alert_ids -= set(Notification.objects.filter(receiver_id=receiver_id, alert_status=status, round=0,
                                                     alert_id__in=alert_ids).values_list("alert_id", flat=True))
    Notification.objects.bulk_create(
        [Notification(alert_id=pk, receiver_id=receiver_id, group=group, alert_status=status, round=0)
         for pk in sorted(alert_ids)], ignore_conflicts=True)
    lead = (of_incident.filter(alert_status=status, round=0, status=NotificationStatus.PENDING)
            .order_by("pk").values_list("pk", flat=True).first())
    if lead is not None:
        transaction.on_commit(lambda: enqueue("alerts.deliver_notification", lead))


def alerts_sync(*, pairs: list, now: datetime) -> AlertChanges:
    """Open, update or resolve the alerts of each (slo, evaluation) pair."""
    changes = AlertChanges()
    still_firing: list[Alert] = []
    firing = {(a.slo_id, a.severity): a for a in Alert.objects.filter(
        status__in=OPEN_STATUSES, slo_id__in=[slo.pk for slo, _ in pairs])}
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
    # An SLO deleted along with its deployment leaves its open alerts without a source: end them.
    for orphan in Alert.objects.filter(status__in=OPEN_STATUSES, slo__isnull=True,
                                        labels__alertname__in=SLO_ALERT_NAMES):
        alert_resolve(alert=orphan, now=now)
        changes.resolved += 1
    return changes


def alert_open(*, slo, severity: str, evaluation, now: datetime) -> Alert:
    labels = alert_labels(slo, severity)
    with transaction.atomic():
        alert = Alert.objects.create(
            fingerprint=fingerprint_of(labels), labels=labels, severity=severity, status=AlertStatus.FIRING,
            annotations=alert_annotations(slo, evaluation, severity), starts_at=now, slo=slo,
            generator_url=f"{settings.INFEROPS_EXTERNAL_URL}{reverse('slo:detail', args=[slo.pk])}",
        )
        _opened(alert, now)
    log.warning("alert opened: %s", alert)
    return alert


def alert_raise(*, labels: dict[str, str], annotations: dict[str, str], severity: str, now: datetime,
                integration=None, generator_url: str = "") -> Alert:
    """An alert not tied to an SLO (an aborted rollout, a degraded deployment, one posted by an
    integration); one open row per label set, updated while it stays open."""
    fingerprint = fingerprint_of(labels)
    with transaction.atomic():
        alert = Alert.objects.select_for_update().filter(fingerprint=fingerprint, status__in=OPEN_STATUSES).first()
        if alert is not None:
            if alert.annotations != annotations:  # re-sent unchanged (Alertmanager repeats): no write
                alert.annotations = annotations
                alert.save(update_fields=["annotations", "updated_at"])
            return alert
        alert = Alert.objects.create(fingerprint=fingerprint, labels=labels, severity=severity,
                                     status=AlertStatus.FIRING, annotations=annotations, starts_at=now,
                                     integration=integration, generator_url=generator_url)
        _opened(alert, now)
    log.warning("alert opened: %s", alert)
    return alert


def _opened(alert: Alert, now: datetime) -> None:
    audit_record(actor=None, action="alert.open", obj=alert, after=snapshot(alert))
    source = f"integration {alert.integration.name}" if alert.integration_id else "the platform"
    record_event(alert, EventKind.OPENED, text=f"{alert.annotations.get('summary', '')} (from {source})", at=now)
    _enqueue_notifications(alert, AlertStatus.FIRING, now)


def alert_resolve(*, alert: Alert, now: datetime, annotations: dict | None = None, actor=None,
                  actor_name: str = "") -> Alert:
    """Resolve an open alert: by its source when the condition clears, or by a person (`actor`)."""
    with transaction.atomic():
        changed = Alert.objects.filter(pk=alert.pk, status__in=OPEN_STATUSES).update(
            status=AlertStatus.RESOLVED, ends_at=now, annotations=annotations or alert.annotations,
            updated_at=timezone.now(), resolved_by=actor_or_none(actor),
        )
        if changed:
            alert.refresh_from_db()
            audit_record(actor=actor, action="alert.resolve", obj=alert, after=snapshot(alert))
            record_event(alert, EventKind.RESOLVED, actor=actor, actor_name=actor_name, at=now,
                         text="resolved by hand" if actor or actor_name else "the condition cleared")
            _enqueue_notifications(alert, AlertStatus.RESOLVED, now)
    return alert


def alerts_resolve_open(*, now: datetime, alertnames: tuple[str, ...], **labels: str) -> int:
    """Resolve the open alerts of these names whose labels have these values (e.g. a deployment's
    aborted-rollout or degradation alerts once it is healthy again); returns how many."""
    matching = Alert.objects.filter(status__in=OPEN_STATUSES, labels__alertname__in=alertnames,
                                    **{f"labels__{key}": value for key, value in labels.items()})
    for alert in matching:
        alert_resolve(alert=alert, now=now)
    return len(matching)


# ---------------------------------------------------------------------------- people acting on alerts


def _locked_open(alert: Alert, doing: str) -> Alert:
    locked = Alert.objects.select_for_update().get(pk=alert.pk)
    if not locked.is_open:
        raise Conflict(f"Alert {alert.pk} is already resolved: nothing to {doing}.")
    return locked


def alert_acknowledge(*, alert: Alert, actor=None, actor_name: str = "") -> Alert:
    """Someone has it: receivers that support it (PagerDuty, Slack) hear so, and escalation stops.
    Acknowledging an acknowledged alert changes nothing."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_open(alert, "acknowledge")
        if locked.status == AlertStatus.ACKNOWLEDGED:
            return locked
        locked.status, locked.acknowledged_at = AlertStatus.ACKNOWLEDGED, now
        locked.acknowledged_by = actor_or_none(actor)
        locked.save(update_fields=["status", "acknowledged_at", "acknowledged_by", "updated_at"])
        audit_record(actor=actor, action="alert.acknowledge", obj=locked, after={"via": actor_name or "console"})
        record_event(locked, EventKind.ACKNOWLEDGED, actor=actor, actor_name=actor_name, at=now)
        _enqueue_notifications(locked, AlertStatus.ACKNOWLEDGED, now)
    return locked


def alert_snooze(*, alert: Alert, actor, minutes: int) -> Alert:
    """Notify no one about it for `minutes` (it still shows, and still resolves)."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_open(alert, "snooze")
        locked.snoozed_until = now + timedelta(minutes=minutes)
        locked.save(update_fields=["snoozed_until", "updated_at"])
        audit_record(actor=actor, action="alert.snooze", obj=locked, after={"minutes": minutes})
        record_event(locked, EventKind.SNOOZED, actor=actor, at=now,
                     text=f"for {minutes} min, until {locked.snoozed_until:%Y-%m-%d %H:%M} UTC")
    return locked


def alert_comment(*, alert: Alert, actor, text: str) -> AlertEvent:
    with transaction.atomic():
        event = record_event(alert, EventKind.COMMENT, actor=actor, text=text)
        audit_record(actor=actor, action="alert.comment", obj=alert, after={"text": text})
    return event


def ack_token(alert: Alert) -> str:
    """The token of an alert's acknowledgement link: signed, for this alert only, and expiring
    (INFEROPS_ACK_LINK_MAX_AGE_S), so a phone is enough and nothing else is reachable with it."""
    return signing.TimestampSigner(salt=ACK_SALT).sign(str(alert.pk))


def ack_url(alert: Alert) -> str:
    return f"{settings.INFEROPS_EXTERNAL_URL}/alerts/ack/{ack_token(alert)}/"


def alert_for_ack_token(token: str) -> Alert:
    """The alert a link acknowledges; raises signing.BadSignature (or SignatureExpired) otherwise."""
    pk = signing.TimestampSigner(salt=ACK_SALT).unsign(token, max_age=settings.INFEROPS_ACK_LINK_MAX_AGE_S)
    return Alert.objects.get(pk=int(pk))


def notify_unmuted(now: datetime | None = None) -> int:
    """Beat: open, unacknowledged alerts that notified no one because they were muted (a silence
    that has ended, a snooze that is over, a page that resolved) notify now. Returns how many."""
    now = now or timezone.now()
    waiting = (Alert.objects.filter(status=AlertStatus.FIRING, events__kind=EventKind.MUTED)
               .exclude(notifications__alert_status=AlertStatus.FIRING)
               .exclude(events__data__unmuted=True).distinct())
    count = 0
    for alert in waiting:
        if not muting_reason(alert, now):
            with transaction.atomic():
                record_event(alert, EventKind.OPENED, text="no longer muted: notifying", at=now,
                             data={"unmuted": True})
                routing.alert_unmuted(alert, now)
            count += 1
    return count


# ---------------------------------------------------------------------------- receivers


def receiver_snapshot(receiver: Receiver) -> dict:
    """What the audit log keeps of a receiver: never the secret, only its last characters, so a
    changed key still shows as a change."""
    data = snapshot(receiver)
    if key := data.get("routing_key"):
        data["routing_key"] = f"****{key[-4:]}" if len(key) >= 16 else "****"
    return data


def receiver_save(*, instance: Receiver | None, fields: dict, actor) -> Receiver:
    """Create a receiver (instance None) or change one; a duplicate name is a Conflict. A new (or
    re-activated) receiver notifies the open groups that had no one to notify."""
    receiver = instance or Receiver()
    before = receiver_snapshot(instance) if instance else None
    was_active = bool(instance and instance.active)
    for name, value in fields.items():
        setattr(receiver, name, value)
    try:
        with transaction.atomic():
            receiver.save()
            audit_record(actor=actor, action="receiver.update" if before else "receiver.create", obj=receiver,
                         before=before, after=receiver_snapshot(receiver))
            if receiver.active and not was_active:  # alert groups may have been waiting for a receiver
                routing.waiting_groups_notify_on_commit()
    except IntegrityError:
        raise Conflict(f"A receiver named {receiver.name!r} already exists.") from None
    return receiver


def receiver_delete(*, receiver: Receiver, actor) -> None:
    """A receiver a route sends to cannot go (the route would notify no one): a Conflict."""
    if routes := list(receiver.routes.values_list("pk", flat=True)):
        raise Conflict(f"Receiver {receiver.name!r} is the receiver of route{'s' if len(routes) > 1 else ''} "
                       f"{', '.join(map(str, routes))}: point them elsewhere first.")
    with transaction.atomic():
        audit_record(actor=actor, action="receiver.delete", obj=receiver, before=receiver_snapshot(receiver))
        receiver.delete()
