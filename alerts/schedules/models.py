"""On-call schedules: layers of members handing off in turn, and overrides above them."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from alerts.choices import (
    Rotation,
)
from inferops.validators import slug_validator


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
