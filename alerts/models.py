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

from django.db import models

from alerts.choices import AlertStatus, DeliveryOutcome, NotificationStatus, Severity
from registry.models import slug_validator


def fingerprint_of(labels: dict[str, str]) -> str:
    """Stable hash of a label set (sorted keys), 16 hex characters like Alertmanager's."""
    canonical = json.dumps(labels, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Alert(models.Model):
    fingerprint = models.CharField(max_length=16, db_index=True)
    labels = models.JSONField(default=dict)
    annotations = models.JSONField(default=dict, help_text="summary, description, runbook_url and the burn rates.")
    severity = models.CharField(max_length=8, choices=Severity.choices)
    status = models.CharField(max_length=8, choices=AlertStatus.choices, default=AlertStatus.FIRING)
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Kept when the SLO is deleted: the alert history outlives its source.
    slo = models.ForeignKey("slo.Slo", null=True, blank=True, on_delete=models.SET_NULL, related_name="alerts")

    class Meta:
        ordering = ["-starts_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["fingerprint"], condition=models.Q(status=AlertStatus.FIRING),
                name="one_firing_alert_per_fingerprint",
            ),
        ]
        indexes = [models.Index(fields=["status", "-starts_at"])]

    def __str__(self) -> str:
        return f"{self.labels.get('alertname', 'alert')} {self.labels.get('slo', '')} {self.severity} {self.status}"


class Receiver(models.Model):
    """A webhook that receives Alertmanager-compatible (version 4) payloads."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    url = models.URLField(max_length=500)
    send_resolved = models.BooleanField(default=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Notification(models.Model):
    """One alert transition (firing or resolved) to send to one receiver."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="notifications")
    receiver = models.ForeignKey(Receiver, on_delete=models.CASCADE, related_name="notifications")
    alert_status = models.CharField(max_length=8, choices=AlertStatus.choices, help_text="The transition announced.")
    status = models.CharField(max_length=8, choices=NotificationStatus.choices, default=NotificationStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    claimed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["alert", "receiver", "alert_status"], name="one_notification_per_transition"
            ),
        ]

    def __str__(self) -> str:
        return f"alert {self.alert_id} {self.alert_status} -> {self.receiver_id}: {self.status}"


class Delivery(models.Model):
    """One HTTP attempt of a notification."""

    notification = models.ForeignKey(Notification, on_delete=models.CASCADE, related_name="deliveries")
    attempt = models.PositiveIntegerField()
    outcome = models.CharField(max_length=16, choices=DeliveryOutcome.choices)
    http_status = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.FloatField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["notification", "attempt"]
        verbose_name_plural = "deliveries"
        constraints = [models.UniqueConstraint(fields=["notification", "attempt"], name="one_delivery_per_attempt")]

    def __str__(self) -> str:
        return f"{self.notification_id} #{self.attempt}: {self.outcome}"
