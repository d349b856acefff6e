"""Eval sets (named, with immutable JSONL versions), eval runs and each case's result."""

from django.db import models

from deployments.models import Deployment, Rollout
from evals.choices import RunStatus, Scorer, TargetKind, Trigger
from inferops.models import Authored, Created
from inferops.validators import slug_validator
from registry.models import ModelVersion, RegisteredModel


class EvalSet(Authored):
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    description = models.TextField(blank=True)
    scorer = models.CharField(max_length=16, choices=Scorer.choices, help_text="Default scorer of its cases.")
    # A version registered for one of these models is scored on this set's latest version by itself.
    default_for = models.ManyToManyField(RegisteredModel, blank=True, related_name="default_eval_sets")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def latest_version(self):
        return self.versions.order_by("-number").first()


class EvalSetVersion(Created):
    """One immutable upload: the JSONL as sent, its sha256, and its cases as parsed and checked."""

    eval_set = models.ForeignKey(EvalSet, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    case_count = models.PositiveIntegerField()
    content = models.TextField(help_text="The JSONL as uploaded.")
    # [{id, prompt | messages, scorer, max_tokens, expected | choices+answer | reference+threshold}], in file order.
    items = models.JSONField(default=list)

    class Meta:
        ordering = ["eval_set__name", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["eval_set", "number"], name="unique_evalset_version_number"),
        ]

    def __str__(self) -> str:
        return f"{self.eval_set.name} v{self.number}"


class EvalRun(Authored):
    """Scoring one eval set version on one target. The row is the run's whole state; a Celery task works it."""

    eval_set = models.ForeignKey(EvalSet, on_delete=models.CASCADE, related_name="runs")
    set_version = models.ForeignKey(EvalSetVersion, on_delete=models.CASCADE, related_name="runs")
    target_kind = models.CharField(max_length=16, choices=TargetKind.choices)
    # The deployment asked for (kept by name too: the run stays readable after the deployment goes).
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    deployment_name = models.CharField(max_length=63, blank=True)
    # The version the scores belong to: the deployment's at start, the one asked for, or the rollout's candidate.
    model_version = models.ForeignKey(ModelVersion, null=True, blank=True, on_delete=models.CASCADE,
                                      related_name="eval_runs")
    engine_args = models.JSONField(default=dict, blank=True)
    rollout = models.ForeignKey(Rollout, null=True, blank=True, on_delete=models.SET_NULL, related_name="eval_runs")
    track = models.CharField(max_length=16, blank=True)
    reference_version = models.ForeignKey(ModelVersion, null=True, blank=True, on_delete=models.SET_NULL,
                                          related_name="+", help_text="Parity compares with this version's output.")
    priority = models.IntegerField(help_text="Engine priority of its requests (lowest by default).")
    concurrency = models.PositiveSmallIntegerField(default=4)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.API)
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    cancel_requested = models.BooleanField(default=False)
    done = models.PositiveIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    # {scorer: {cases, passed, score, ...the scorer's own figures (acc, acc_norm, mean_similarity, ...)}}
    scores = models.JSONField(default=dict, blank=True)
    score = models.FloatField(null=True, blank=True, help_text="Fraction of cases passed.")
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    # {"p50": ms, "p90": ms, "p95": ms, "p99": ms} over its requests' end-to-end latency.
    latency_ms = models.JSONField(default=dict, blank=True)
    usd = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True)
    error = models.TextField(blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    # Written by the runner while it works; a running run whose heartbeat stops is failed by the reaper.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["model_version", "set_version", "status"]),
            models.Index(fields=["status"]),
        ]

    def __str__(self) -> str:
        return f"eval run {self.pk} ({self.eval_set.name})"


class EvalCaseResult(models.Model):
    """One case of a run: what the model answered, its score, and why it failed."""

    run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="cases")
    index = models.PositiveIntegerField(help_text="Line order in the set version, from 0.")
    case_id = models.CharField(max_length=200)
    scorer = models.CharField(max_length=16, choices=Scorer.choices)
    output = models.TextField(blank=True)
    score = models.FloatField()
    passed = models.BooleanField()
    reason = models.TextField(blank=True, help_text="Why it failed, in words.")
    detail = models.JSONField(default=dict, blank=True, help_text="The scorer's figures for this case.")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    latency_ms = models.FloatField(default=0)

    class Meta:
        ordering = ["run", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "case_id"], name="unique_case_per_run")]
        indexes = [models.Index(fields=["run", "passed"])]

    def __str__(self) -> str:
        return f"run {self.run_id} case {self.case_id}"
