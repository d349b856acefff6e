from django.conf import settings
from django.db import models

from deployments.choices import ACTIVE_ROLLOUT, Backend, DeploymentStatus, DriverName, RolloutStatus, Strategy, Verdict
from registry.models import ModelVersion, RegisteredModel, slug_validator


class Deployment(models.Model):
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
    resources = models.JSONField(default=dict, blank=True)
    paused = models.BooleanField(default=False, help_text="Reconciliation paused by an operator.")
    status = models.CharField(max_length=16, choices=DeploymentStatus.choices, default=DeploymentStatus.PENDING)
    status_message = models.TextField(blank=True)
    last_scaled_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Rollout(models.Model):
    """Moving a deployment from its stable spec to a candidate spec, step by step.

    The row is the whole state: the reconcile pass reads it to keep two tracks of replicas and
    publish their weights, and advances it (deployments/rollouts.py) one transition at a time,
    so a worker killed at any point leaves a row the next pass continues from.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="rollouts")
    strategy = models.CharField(max_length=16, choices=Strategy.choices, default=Strategy.CANARY)
    # Normalised steps: {"set_weight": 20}, {"pause": 60.0} or {"pause": None} (until promoted),
    # {"analysis": {"duration": 120.0, "min_requests": 20, "max_burn_rate": 2.0, "thresholds": {}}}.
    steps = models.JSONField(default=list, blank=True)
    scale_down_delay_s = models.FloatField(default=0, help_text="Blue-green: how long the old set stays warm.")
    rollback = models.BooleanField(default=False, help_text="Undo or an explicit rollback: no budget gate.")
    override_reason = models.TextField(blank=True, help_text="Why the error-budget policy was overridden.")
    stable_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    stable_engine_args = models.JSONField(default=dict, blank=True)
    candidate_version = models.ForeignKey(ModelVersion, on_delete=models.PROTECT, related_name="+")
    candidate_engine_args = models.JSONField(default=dict, blank=True)
    candidate_alias = models.CharField(max_length=63, blank=True)
    # The alias moved to the candidate on success ("" to move none).
    promote_alias = models.CharField(max_length=63, blank=True, default="champion")
    status = models.CharField(max_length=16, choices=RolloutStatus.choices, default=RolloutStatus.PROGRESSING)
    attempt = models.PositiveIntegerField(default=1, help_text="1, then one more per retry.")
    step_index = models.PositiveIntegerField(default=0, help_text="len(steps) once every step is done.")
    step_started_at = models.DateTimeField()
    weight = models.PositiveSmallIntegerField(default=0, help_text="Percent of traffic on the candidate now.")
    message = models.TextField(blank=True, help_text="What the rollout waits for, or why it stopped.")
    timeline = models.JSONField(default=list, blank=True, help_text="[{at, event, detail}], oldest first.")
    scale_down_at = models.DateTimeField(null=True, blank=True, help_text="Blue-green: old set stopped then.")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"], condition=models.Q(status__in=["progressing", "paused"]),
                name="one_active_rollout_per_deployment",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name} rollout {self.pk}"

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_ROLLOUT

    @property
    def current_step(self) -> dict | None:
        return self.steps[self.step_index] if self.step_index < len(self.steps) else None


class RolloutMeasurement(models.Model):
    """One look at candidate vs stable during an analysis step, with every check and its verdict."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="measurements")
    attempt = models.PositiveIntegerField(default=1)
    step_index = models.PositiveIntegerField()
    taken_at = models.DateTimeField()
    window_start = models.DateTimeField()
    window_end = models.DateTimeField()
    verdict = models.CharField(max_length=16, choices=Verdict.choices)
    candidate = models.JSONField(default=dict, help_text="requests, failures, latency percentiles, burn per SLO.")
    stable = models.JSONField(default=dict)
    checks = models.JSONField(default=list, help_text="[{name, candidate, stable, limit, ok}]")
    reason = models.TextField(blank=True)

    class Meta:
        ordering = ["rollout", "taken_at", "id"]
        indexes = [models.Index(fields=["rollout", "step_index"])]

    def __str__(self) -> str:
        return f"rollout {self.rollout_id} step {self.step_index}: {self.verdict}"
