"""A deployment's degradation policy, the level it is at, and every change of level.

The policy engine (degradation/engine.py) moves the level from the SLO burn rates of each
evaluation cycle; the actions of the level in force are copied to `Deployment.degradation`,
which the routing table publishes to the gateways, the autoscaler and the rollout machine read.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from deployments.models import Deployment
from inferops.models import Authored
from slo.models import Slo


class DegradationPolicy(Authored):
    """Ordered levels, each entered above its entry burn rate and left below its exit burn rate.

    `levels`: [{"name", "enter_burn_rate", "exit_burn_rate", "actions": {"shed_below_priority",
    "max_tokens_cap", "fallback": {"deployment", "weight", "priorities"}, "scale_up",
    "freeze_rollouts"}}], level 1 first; checked by degradation.api.PolicySerializer.
    """

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE, related_name="degradation_policy")
    enabled = models.BooleanField(default=True)
    window_minutes = models.PositiveSmallIntegerField(
        default=5, help_text="The burn rate is read over this many minutes (1 to 60) of the SLOs' per-request SLIs.")
    hold_s = models.PositiveIntegerField(default=60, help_text="No level is left sooner than this after entering it.")
    # Empty: every SLO covering the deployment.
    slos = models.ManyToManyField(Slo, blank=True, related_name="degradation_policies")
    levels = models.JSONField(default=list)

    class Meta:
        verbose_name_plural = "degradation policies"

    def __str__(self) -> str:
        return f"degradation policy of {self.deployment.name}"


class DegradationState(models.Model):
    """Where a deployment's degradation stands; one row, locked by every change."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE, primary_key=True,
                                      related_name="degradation_state")
    level = models.PositiveSmallIntegerField(default=0, help_text="0: normal; n: the policy's n-th level.")
    since = models.DateTimeField(null=True, blank=True, help_text="When the current level was entered.")
    burn_rates = models.JSONField(default=dict, blank=True, help_text="SLO name -> burn rate at the last cycle.")
    evaluated_at = models.DateTimeField(null=True, blank=True)
    # Re-entries of a level soon after leaving it, in a row: each doubles the hold (flap damping).
    relapses = models.PositiveSmallIntegerField(default=0)
    measured_at = models.DateTimeField(
        null=True, blank=True, help_text="The last cycle in which a watched SLO had enough requests to show a burn.")
    # An operator's override: this level (0 = degradation off) until `override_until`.
    override_level = models.PositiveSmallIntegerField(null=True, blank=True)
    override_until = models.DateTimeField(null=True, blank=True)
    override_reason = models.TextField(blank=True)
    override_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")

    def __str__(self) -> str:
        return f"{self.deployment_id}: level {self.level}"


class LevelChange(models.Model):
    """One move of a deployment's degradation level, with why and the burn rates seen."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="degradation_changes")
    at = models.DateTimeField()
    from_level = models.PositiveSmallIntegerField()
    to_level = models.PositiveSmallIntegerField()
    reason = models.TextField()
    burn_rates = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+", help_text="Set when an operator forced it; empty: the policy.")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["deployment", "-at"])]

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.from_level} -> {self.to_level} at {self.at:%Y-%m-%d %H:%M:%S}"
