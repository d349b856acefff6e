"""What a row of an alert list shows at a glance beside status and severity: whether the alert is
muted (matched by an active silence, snoozed), who acknowledged it, whether its latest notification
delivery is failing, and where it came from.

Every list of alerts (the alert list, the home page's "Firing now", the SLO pages) builds its
queryset with `with_flag_columns` and calls `attach_flags` on the page it shows: one query for
the page (the latest delivery is a subquery column) and one for the active silences, however many
alerts the page holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.db.models import OuterRef, QuerySet, Subquery
from django.urls import NoReverseMatch, reverse

from alerts.choices import OPEN_STATUSES, AlertStatus, DeliveryOutcome
from alerts.models import Alert, Delivery, Silence
from alerts.silences.muting import active_silences, silence_matching


@dataclass(frozen=True)
class Source:
    """Where an alert came from, as a list shows it; `admin_only` links lead to an admins' page."""

    text: str
    url: str = ""
    admin_only: bool = False


@dataclass(frozen=True)
class AlertFlags:
    silence: Silence | None
    snoozed_until: datetime | None
    acknowledged: bool
    acknowledged_by: str
    delivery_error: str  # the latest delivery's error while it is failing, else ""
    delivery_failing: bool
    source: Source

    @property
    def muted(self) -> bool:
        """It notifies no one now: a silenced or snoozed firing alert is not a live page."""
        return self.silence is not None or self.snoozed_until is not None


def with_flag_columns(alerts: QuerySet) -> QuerySet:
    """The alerts with what their flags read: the rows they point to and their latest delivery."""
    latest = Delivery.objects.filter(notification__alert=OuterRef("pk")).order_by("-created_at", "-pk")
    return alerts.select_related("slo", "integration", "acknowledged_by").annotate(
        latest_delivery_outcome=Subquery(latest.values("outcome")[:1]),
        latest_delivery_error=Subquery(latest.values("error")[:1]),
    )


def attach_flags(alerts: Iterable[Alert], now: datetime) -> list[Alert]:
    """Set `alert.flags` on each alert (from a `with_flag_columns` queryset); returns them as a list."""
    alerts = list(alerts)
    silences = active_silences(now) if any(alert.is_open for alert in alerts) else []
    for alert in alerts:
        alert.flags = flags_of(alert, silences, now)
    return alerts


def flags_of(alert: Alert, silences: list[Silence], now: datetime) -> AlertFlags:
    is_open = alert.is_open
    outcome = getattr(alert, "latest_delivery_outcome", None)
    failing = outcome is not None and outcome != DeliveryOutcome.OK
    acknowledged = alert.status == AlertStatus.ACKNOWLEDGED
    return AlertFlags(
        silence=silence_matching(alert.labels, silences) if is_open else None,
        snoozed_until=alert.snoozed_until if is_open and alert.snoozed_until and alert.snoozed_until > now else None,
        acknowledged=acknowledged,
        acknowledged_by=alert.acknowledged_by.username if acknowledged and alert.acknowledged_by_id else "",
        delivery_failing=failing,
        delivery_error=(getattr(alert, "latest_delivery_error", "") or outcome or "") if failing else "",
        source=source_of(alert),
    )


def source_of(alert: Alert) -> Source:
    """The SLO that raised it, the integration that posted it, else the rollout or deployment its
    platform labels name. An integration's labels are not ours to link: they may name anything."""
    if alert.slo_id:
        return Source(alert.slo.name, reverse("slo:detail", args=[alert.slo_id]))
    if alert.integration_id:
        return Source(alert.integration.name, f"{reverse('alerts:integrations')}#integration-{alert.integration_id}",
                      admin_only=True)
    labels = alert.labels
    try:
        if labels.get("rollout") and labels.get("deployment"):
            return Source(f"rollout {labels['rollout']} of {labels['deployment']}",
                          reverse("deployments:rollout", args=[labels["deployment"], labels["rollout"]]))
        if labels.get("deployment"):
            return Source(labels["deployment"], reverse("deployments:detail", args=[labels["deployment"]]))
    except NoReverseMatch:  # labels posted before the integration was deleted: shown, not linked
        return Source(labels.get("deployment", ""))
    return Source(labels.get("slo") or "—")


def muted_count(alerts: QuerySet, now: datetime) -> int:
    """How many of these (open) alerts are silenced or snoozed now, reading only labels and snoozes."""
    silences = active_silences(now)
    return sum(1 for labels, snoozed_until in alerts.filter(status__in=OPEN_STATUSES)
               .values_list("labels", "snoozed_until")
               if (snoozed_until and snoozed_until > now) or silence_matching(labels, silences))
