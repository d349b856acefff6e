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
    DeliveryOutcome,
    EventKind,
    IncidentPer,
    NotificationStatus,
    ReceiverKind,
    Rotation,
    Severity,
)
from inferops.validators import slug_validator


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


class Integration(models.Model):
    """An outside alert source (e.g. a team's Alertmanager) posting with its own bearer token."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    token_prefix = models.CharField(max_length=16, help_text="The token's first characters, to recognise it.")
    token_hash = models.CharField(max_length=64, unique=True, help_text="sha256 of the token; the token is shown once.")
    active = models.BooleanField(default=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Silence(models.Model):
    """Alertmanager's silence: alerts matching every matcher between the two times notify no one."""

    # [{"name", "value", "isRegex", "isEqual"}], as Alertmanager's API v2 writes them.
    matchers = models.JSONField()
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    created_by = models.CharField(max_length=150)
    comment = models.TextField()
    author = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="+", help_text="The user who made it (created_by is free text).")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-starts_at", "-id"]
        indexes = [models.Index(fields=["ends_at"])]

    def __str__(self) -> str:
        return f"silence {self.pk}: {self.matchers} until {self.ends_at:%Y-%m-%d %H:%M}"


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

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="notifications")
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


class Route(models.Model):
    """A node of Alertmanager's routing tree. An alert walks down from the default route: the
    first child whose matchers all hold takes it (and its siblings too when it says `continue`),
    recursively; the deepest routes that took it notify their receiver or escalation policy,
    grouped by `group_by`. Unset grouping settings are inherited from the parent."""

    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="children",
                               help_text="Null only for the default route.")
    is_default = models.BooleanField(default=False, editable=False)
    position = models.IntegerField(default=0, help_text="Order among siblings: lower is tried first.")
    # [{"name", "value", "op"}] with op one of = != =~ !~ (regexes anchored, as Alertmanager's).
    matchers = models.JSONField(default=list, blank=True)
    receiver = models.ForeignKey(Receiver, null=True, blank=True, on_delete=models.PROTECT, related_name="routes")
    escalation_policy = models.ForeignKey("EscalationPolicy", null=True, blank=True, on_delete=models.PROTECT,
                                          related_name="routes")
    group_by = models.JSONField(null=True, blank=True, help_text='Label names; ["..."] groups by every label.')
    group_wait_s = models.PositiveIntegerField(null=True, blank=True)
    group_interval_s = models.PositiveIntegerField(null=True, blank=True)
    repeat_interval_s = models.PositiveIntegerField(null=True, blank=True)
    continue_matching = models.BooleanField(default=False, help_text="Alertmanager's `continue`.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["position", "id"]
        constraints = [
            models.UniqueConstraint(fields=["is_default"], condition=models.Q(is_default=True),
                                    name="one_default_route"),
            models.CheckConstraint(condition=models.Q(receiver__isnull=True) | models.Q(escalation_policy__isnull=True),
                                   name="route_receiver_or_policy"),
        ]

    def __str__(self) -> str:
        return "default route" if self.is_default else f"route {self.pk}"


class AlertGroup(models.Model):
    """The alerts one route groups under the same values of its `group_by` labels, and when the
    group is next due: `flush_at` for new alerts (group_wait, then group_interval), `round_at` for
    the next escalation step or repeat (repeat_interval)."""

    route = models.ForeignKey(Route, on_delete=models.CASCADE, related_name="groups")
    key = models.CharField(max_length=64)
    labels = models.JSONField(default=dict, help_text="The group_by labels and their values.")
    alerts = models.ManyToManyField(Alert, related_name="groups", blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # When this episode (open alerts without a break) was first notified; null before.
    first_notified_at = models.DateTimeField(null=True, blank=True)
    last_flushed_at = models.DateTimeField(null=True, blank=True)
    flush_at = models.DateTimeField(null=True, blank=True, db_index=True)
    round = models.PositiveIntegerField(default=0)
    round_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["route", "key"], name="one_group_per_route_and_key")]

    def __str__(self) -> str:
        return f"group {self.pk} of {self.route}: {self.labels}"


class EscalationPolicy(models.Model):
    """Who is notified while an alert stays unacknowledged: step after step, each a given number
    of minutes after the group was first notified."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "escalation policies"

    def __str__(self) -> str:
        return self.name


class EscalationStep(models.Model):
    policy = models.ForeignKey(EscalationPolicy, on_delete=models.CASCADE, related_name="steps")
    position = models.PositiveIntegerField()
    after_minutes = models.PositiveIntegerField(help_text="Minutes after the first notification, if unacknowledged.")
    receivers = models.ManyToManyField(Receiver, blank=True, related_name="escalation_steps")
    users = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="escalation_steps")
    schedule = models.ForeignKey("Schedule", null=True, blank=True, on_delete=models.PROTECT,
                                 related_name="escalation_steps", help_text="Notify whoever is on call then.")

    class Meta:
        ordering = ["policy", "position"]
        constraints = [models.UniqueConstraint(fields=["policy", "position"], name="one_step_per_position")]

    def __str__(self) -> str:
        return f"{self.policy} step {self.position + 1} after {self.after_minutes} min"


class Schedule(models.Model):
    """An on-call schedule: layers of rotations (a higher layer wins where it has someone) and
    temporary overrides on top."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    time_zone = models.CharField(max_length=64, default="UTC", help_text="Hand-offs happen at local time here.")
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ScheduleLayer(models.Model):
    """A rotation of users: each in turn for a day or a week, handing off at the local time of
    `starts_at` in the schedule's time zone."""

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="layers")
    position = models.PositiveIntegerField(help_text="Higher layers override lower ones.")
    name = models.CharField(max_length=63, blank=True)
    rotation = models.CharField(max_length=8, choices=Rotation.choices, default=Rotation.WEEKLY)
    starts_at = models.DateTimeField(help_text="The first hand-off: the first user's first shift starts here.")
    ends_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["schedule", "position"]
        constraints = [models.UniqueConstraint(fields=["schedule", "position"], name="one_layer_per_position")]

    def __str__(self) -> str:
        return f"{self.schedule} layer {self.position + 1}"


class LayerMember(models.Model):
    """One user's turn in a layer's rotation (the same user may take several turns)."""

    layer = models.ForeignKey(ScheduleLayer, on_delete=models.CASCADE, related_name="members")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    position = models.PositiveIntegerField()

    class Meta:
        ordering = ["layer", "position"]
        constraints = [models.UniqueConstraint(fields=["layer", "position"], name="one_member_per_position")]

    def __str__(self) -> str:
        return f"{self.layer}: {self.user} #{self.position + 1}"


class ScheduleOverride(models.Model):
    """Someone else takes the schedule for a while (a swap, a sick day)."""

    schedule = models.ForeignKey(Schedule, on_delete=models.CASCADE, related_name="overrides")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField()
    reason = models.CharField(max_length=200, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["starts_at", "id"]
        constraints = [models.CheckConstraint(condition=models.Q(ends_at__gt=models.F("starts_at")),
                                              name="override_ends_after_it_starts")]

    def __str__(self) -> str:
        return f"{self.schedule}: {self.user} {self.starts_at:%Y-%m-%d %H:%M}–{self.ends_at:%Y-%m-%d %H:%M}"
