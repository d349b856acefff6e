"""Receivers, the notifications they are sent (claimed once by a worker) and each delivery attempt."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from alerts.choices import (
    AlertStatus,
    DeliveryOutcome,
    IncidentPer,
    NotificationStatus,
    ReceiverKind,
)
from inferops.validators import slug_validator


class Receiver(models.Model):
    """Where notifications go: a webhook (Alertmanager v4 payload), PagerDuty Events API v2, a
    Slack-compatible incoming webhook, or email addresses."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    kind = models.CharField(max_length=16, choices=ReceiverKind.choices, default=ReceiverKind.WEBHOOK)
    url = models.URLField(max_length=500, blank=True, help_text="Webhook, PagerDuty events or Slack URL.")
    routing_key = models.CharField(max_length=200, blank=True, help_text="PagerDuty's integration key (write-only).")
    to = models.JSONField(default=list, blank=True, help_text="Email addresses.")
    incident_per = models.CharField(
        max_length=8, choices=IncidentPer.choices, default=IncidentPer.GROUP,
        help_text="PagerDuty: one incident per notification group (as Alertmanager's integration), or per alert.")
    send_resolved = models.BooleanField(default=True)
    active = models.BooleanField(default=True)
    # Set when a delivery ended in a permanent error (a wrong URL or key), cleared by the next success.
    failing_since = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Notification(models.Model):
    """One alert transition (firing, acknowledged, resolved) for one target: a receiver, or a person
    paged by email through an escalation step. Notifications of one group, target, transition and
    round are sent together as one message; `round` counts the group's escalation steps and
    repeats, so each round notifies each target of each alert exactly once."""

    alert = models.ForeignKey("Alert", on_delete=models.CASCADE, related_name="notifications")
    receiver = models.ForeignKey(Receiver, null=True, blank=True, on_delete=models.CASCADE,
                                 related_name="notifications")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="alert_notifications", help_text="A person paged by email.")
    group = models.ForeignKey("AlertGroup", null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="notifications")
    round = models.PositiveIntegerField(default=0, help_text="The group's escalation step or repeat.")
    alert_status = models.CharField(max_length=16, choices=AlertStatus.choices, help_text="The transition announced.")
    status = models.CharField(max_length=8, choices=NotificationStatus.choices, default=NotificationStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    # The worker's claim: the rows it sends as one message.
    batch = models.UUIDField(null=True, blank=True, db_index=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(receiver__isnull=False, user__isnull=True)
                | models.Q(receiver__isnull=True, user__isnull=False),
                name="notification_has_one_target"),
            models.UniqueConstraint(fields=["alert", "receiver", "alert_status", "round"],
                                    condition=models.Q(receiver__isnull=False),
                                    name="one_receiver_notification_per_transition"),
            models.UniqueConstraint(fields=["alert", "user", "alert_status", "round"],
                                    condition=models.Q(user__isnull=False),
                                    name="one_user_notification_per_transition"),
        ]
        indexes = [models.Index(fields=["group", "alert_status", "round", "status"])]

    def __str__(self) -> str:
        target = f"receiver {self.receiver_id}" if self.receiver_id else f"user {self.user_id}"
        return f"alert {self.alert_id} {self.alert_status} -> {target}: {self.status}"

    @property
    def target_name(self) -> str:
        return self.receiver.name if self.receiver_id else f"@{self.user.username}"

    @property
    def target_description(self) -> str:
        return (f"{self.receiver.name} ({self.receiver.get_kind_display()})" if self.receiver_id
                else f"@{self.user.username} (email)")


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
