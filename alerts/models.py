"""Alerts raised by SLO evaluation, the webhooks that hear about them, and every delivery attempt.

An alert row opens once per firing episode (a partial unique index on its fingerprint while
firing), is updated in place while it keeps firing, and is resolved, never deleted: the
history is the list of rows. A `Notification` is one message (an alert opening or resolving)
for one receiver; workers claim it with a conditional UPDATE so a redelivered Celery task
never sends twice, and record a `Delivery` per HTTP attempt.
"""

from __future__ import annotations

import hashlib
import json
from urllib.parse import urlsplit

from django.conf import settings
from django.db import models
from django.urls import reverse

from alerts.choices import (
    OPEN_STATUSES,
    AlertStatus,
    EventKind,
    Severity,
)

# Each concern keeps its models beside its code; this module names them all for Django.
from alerts.inbound.models import Integration
from alerts.receivers.models import Delivery, Notification, Receiver
from alerts.routing.models import AlertGroup, EscalationPolicy, EscalationStep, Route
from alerts.schedules.models import LayerMember, Schedule, ScheduleLayer, ScheduleOverride
from alerts.silences.models import Silence


def fingerprint_of(labels: dict[str, str]) -> str:
    """Stable hash of a label set (sorted keys), 16 hex characters like Alertmanager's."""
    canonical = json.dumps(labels, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Alert(models.Model):
    fingerprint = models.CharField(max_length=16, db_index=True)
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict, help_text="summary, description, runbook_url and the burn rates.")
    severity = models.CharField(max_length=8, choices=Severity.choices)
    status = models.CharField(max_length=16, choices=AlertStatus.choices, default=AlertStatus.FIRING)
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Kept when the SLO is deleted: the alert history outlives its source.
    slo = models.ForeignKey("slo.Slo", null=True, blank=True, on_delete=models.SET_NULL, related_name="alerts")
    # Where it came from: empty for the platform's own, else the integration that posted it.
    integration = models.ForeignKey("Integration", null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="alerts")
    generator_url = models.URLField(max_length=1000, blank=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+")
    # Notifies no one until then (it still shows, and still resolves).
    snoozed_until = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+", help_text="Set when a person resolved it by hand.")

    class Meta:
        ordering = ["-starts_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["fingerprint"], condition=models.Q(status__in=OPEN_STATUSES),
                name="one_open_alert_per_fingerprint",
            ),
        ]
        indexes = [models.Index(fields=["status", "-starts_at"])]

    def __str__(self) -> str:
        return f"{self.labels.get('alertname', 'alert')} {self.labels.get('slo', '')} {self.severity} {self.status}"

    def get_absolute_url(self) -> str:
        return reverse("alerts:detail", args=[self.pk])

    @property
    def is_open(self) -> bool:
        return self.status in OPEN_STATUSES

    def source_link(self) -> str:
        """Where it was raised, or "": its SLO's console page (by id, looked up now, so rows stored
        with an older link still point somewhere live), else the http(s) generatorURL its integration
        posted (anything else, a relative path or a javascript: link, is not a link to send)."""
        if self.slo_id:
            return reverse("slo:detail", args=[self.slo_id])
        posted = urlsplit(self.generator_url)
        if self.integration_id and posted.scheme in ("http", "https") and posted.netloc:
            return self.generator_url
        return ""


class AlertEvent(models.Model):
    """One entry of an alert's timeline: state changes, comments, notifications and by whom."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField()
    kind = models.CharField(max_length=16, choices=EventKind.choices)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_name = models.CharField(max_length=150, blank=True, help_text="Who: a user, 'signed link', or empty for "
                                                                        "the platform.")
    text = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["alert", "at"])]

    def __str__(self) -> str:
        return f"alert {self.alert_id} {self.kind} at {self.at:%Y-%m-%d %H:%M:%S}"


__all__ = ["Alert", "AlertEvent", "AlertGroup", "Delivery", "EscalationPolicy", "EscalationStep", "Integration",
           "LayerMember", "Notification", "Receiver", "Route", "Schedule", "ScheduleLayer", "ScheduleOverride",
           "Silence", "fingerprint_of"]
