"""The routing tree, notification groups and escalation policies."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from inferops.validators import slug_validator


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
    receiver = models.ForeignKey("Receiver", null=True, blank=True, on_delete=models.PROTECT, related_name="routes")
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
    alerts = models.ManyToManyField("Alert", related_name="groups", blank=True)
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
    receivers = models.ManyToManyField("Receiver", blank=True, related_name="escalation_steps")
    users = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="escalation_steps")
    schedule = models.ForeignKey("Schedule", null=True, blank=True, on_delete=models.PROTECT,
                                 related_name="escalation_steps", help_text="Notify whoever is on call then.")

    class Meta:
        ordering = ["policy", "position"]
        constraints = [models.UniqueConstraint(fields=["policy", "position"], name="one_step_per_position")]

    def __str__(self) -> str:
        return f"{self.policy} step {self.position + 1} after {self.after_minutes} min"
