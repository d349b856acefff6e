
from django.db import models

from deployments.choices import (
    Backend,
    DeploymentStatus,
    DriverName,
)

# Each concern keeps its models beside its code (replicas/, rollouts/); this module names them all for Django.
from deployments.replicas.models import (
    MetricsBucket,
    Replica,
    ReplicaMetricsHour,
    ReplicaMetricsMinute,
    ReplicaStart,
)
from deployments.rollouts.models import Rollout, RolloutMeasurement
from inferops.models import Authored
from inferops.validators import slug_validator
from registry.models import ModelVersion, RegisteredModel


class Deployment(Authored):
    """What serves a route: a pinned model version on N replicas behind `name`."""

    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    model = models.ForeignKey(RegisteredModel, on_delete=models.PROTECT, related_name="deployments")
    version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="deployments")
    # The alias the version was resolved from, if any; the version stays pinned until updated.
    alias = models.CharField(max_length=63, blank=True)
    backend = models.CharField(max_length=16, choices=Backend.choices, default=Backend.BUILTIN)
    driver = models.CharField(max_length=16, choices=DriverName.choices, default=DriverName.LOCAL)
    engine_args = models.JSONField(default=dict, blank=True)
    replicas = models.PositiveIntegerField(default=1)
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=1)
    autoscale = models.BooleanField(default=False)
    # The autoscaling policy beyond on/off and the bounds (capacity/policy.py validates and reads it):
    # {signals: {name: target}, scale_up: {step, stabilization_s}, scale_down: {step, stabilization_s},
    # cooldown_s, park_after_s, hold: {max_wait_s, max_queue}}; {} means the defaults.
    autoscaling = models.JSONField(default=dict, blank=True)
    resources = models.JSONField(default=dict, blank=True)
    paused = models.BooleanField(default=False, help_text="Reconciliation paused by an operator.")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    # Set by the degradation policy (degradation app): the actions of its level in force, published
    # in the routing table for the gateway ({level, name, shed_below_priority, ...}); null at level 0.
    # The autoscaler reads `scale_up` and the rollout machine `freeze_rollouts` from it.
    degradation = models.JSONField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


__all__ = ["Deployment", "MetricsBucket", "Replica", "ReplicaMetricsHour", "ReplicaMetricsMinute", "ReplicaStart",
           "Rollout", "RolloutMeasurement"]
