"""Elastic capacity: the autoscaler's samples and decisions, and measured goodput curves for planning.

The policy itself lives on the deployment (`Deployment.autoscale`, `min_replicas`, `max_replicas`,
`autoscaling`), where the reconcile loop and the routing table read it; this app decides.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from capacity.choices import CurveSource, DecisionKind, RunStatus
from deployments.models import Deployment
from registry.models import ModelVersion


class ScalingState(models.Model):
    """The autoscaler's recent samples of one deployment (what its stabilisation windows look back on)."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE, related_name="scaling_state",
                                      primary_key=True)
    # [{at: unix s, replicas, ready, waiting, running, kv, requests (counter), ttft/itl buckets, ...}]
    samples = models.JSONField(default=list, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.deployment_id}: {len(self.samples)} samples"


class ScalingDecision(models.Model):
    """One change of a deployment's replica count by the autoscaler, with why."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="scaling_decisions")
    at = models.DateTimeField()
    kind = models.CharField(max_length=8, choices=DecisionKind.choices)
    from_replicas = models.PositiveIntegerField()
    to_replicas = models.PositiveIntegerField()
    reason = models.TextField()
    # What each signal measured and recommended: {signal: {value, target, replicas}}.
    signals = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["deployment", "at"])]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.from_replicas} -> {self.to_replicas} @ {self.at:%Y-%m-%d %H:%M:%S}"


class CapacityCurve(models.Model):
    """Measured goodput of one replica of a version on some hardware, at stepped request rates.

    `points`: [{rps (offered), throughput_rps, goodput_rps, ttft_p95_ms, tpot_p95_ms, completed,
    failed}], by rising rate. `slo_ms`: the {ttft, tpot} thresholds goodput was counted against.
    """

    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="capacity_curves")
    hardware = models.CharField(max_length=200)
    engine_args = models.JSONField(default=dict, blank=True)
    deployment = models.CharField(max_length=63, blank=True, help_text="Where it was measured, if on one.")
    source = models.CharField(max_length=16, choices=CurveSource.choices)
    input_len = models.PositiveIntegerField()
    output_len = models.PositiveIntegerField()
    slo_ms = models.JSONField(default=dict, blank=True)
    points = models.JSONField(default=list)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["version", "hardware", "created_at"])]

    def __str__(self) -> str:
        return f"v{self.version_id} on {self.hardware} @ {self.created_at:%Y-%m-%d %H:%M}"


class CapacityRun(models.Model):
    """A short stepped-rate benchmark against one replica of a deployment, at the lowest priority."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="capacity_runs")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    rates = models.JSONField(default=list)
    step_s = models.FloatField()
    input_len = models.PositiveIntegerField()
    output_len = models.PositiveIntegerField()
    curve = models.ForeignKey(CapacityCurve, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"capacity run {self.pk} of {self.deployment_id} ({self.status})"
