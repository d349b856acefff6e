"""A rollout's row (its whole state) and each measurement its analysis takes."""

from datetime import datetime

from django.db import models
from django.utils import timezone

from deployments.choices import (
    ACTIVE_ROLLOUT,
    RolloutStatus,
    Strategy,
    Verdict,
)
from inferops.models import Authored
from registry.models import ModelVersion


class Rollout(Authored):
    """Moving a deployment from its stable spec to a candidate spec, step by step.

    The row is the whole state: the reconcile pass reads it to keep two tracks of replicas and
    publish their weights, and advances it (deployments/rollouts/services.py) one transition at a time,
    so a worker killed at any point leaves a row the next pass continues from.
    """

    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="rollouts")
    strategy = models.CharField(max_length=16, choices=Strategy.choices, default=Strategy.CANARY)
    # Normalised steps: {"set_weight": 20}, {"pause": 60.0} or {"pause": None} (until promoted),
    # {"analysis": {"duration": 120.0, "min_requests": 20, "max_burn_rate": 2.0, "thresholds": {}}},
    # {"quality": {"eval_set": "tiny-facts", "set_version": None, "max_drop": 0.05, "min_score": None,
    #              "timeout": 900.0}}.
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
    finished_at = models.DateTimeField(null=True, blank=True)
    # Set while a degradation level that freezes rollouts holds the rollout where it is.
    frozen_since = models.DateTimeField(null=True, blank=True)
    # After success the platform watches the new version for this long and rolls back by itself
    # when it burns an SLO the previous version did not (deployments/rollouts/watch.py).
    watch_s = models.FloatField(default=600, help_text="Watch after success, in seconds; 0: none.")
    auto_rollback = models.BooleanField(default=True, help_text="Roll back by itself during the watch.")
    watch_until = models.DateTimeField(null=True, blank=True, help_text="Set on success; rollbacks are not watched.")
    # During the watch this percent of traffic stays on the previous spec, so the new one is judged
    # against it at the same time, under the same load (deployments/rollouts/watch.py).
    holdback_percent = models.PositiveSmallIntegerField(default=5, help_text=(
        "During the watch, percent of traffic kept on the previous version to compare with; 0: none."))
    rolled_back_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
                                       help_text="The rollback rollout the platform started during the watch.")
    # Each quality step's eval runs and its latest look, by attempt and step: {"<attempt>.<step>": {eval_set,
    # state (what the evals app keeps: runs, set version, the stable score's basis), verdict, reason, link,
    # candidate, stable, checks}}. Kept on the row, so a step starts its runs once (rollouts/machine.py).
    quality = models.JSONField(default=dict, blank=True, help_text="Quality steps' eval runs and verdicts.")

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

    def in_watch(self, now: datetime | None = None) -> bool:
        """Within its watch after success (at `now`, default now), whether or not automatic rollback is on."""
        return (self.status == RolloutStatus.SUCCEEDED and self.watch_until is not None
                and (now or timezone.now()) < self.watch_until)

    @property
    def watching(self) -> bool:
        """The platform watches it now, ready to roll it back."""
        return self.auto_rollback and self.in_watch()

    def holding_back(self, now: datetime | None = None) -> bool:
        """Watched now with part of the traffic kept on the previous spec to compare with."""
        return self.auto_rollback and not self.rollback and self.holdback_percent > 0 and self.in_watch(now)


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
