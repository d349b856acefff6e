"""SLOs, their per-minute SLI counts and their evaluated state.

`SloMinute` keeps, besides a minute's good/total counts, running totals since the SLO's first
minute (`cum_*`). The sum over any window is then the difference of two running totals, read
with two index probes, so an evaluation cycle costs the same at 1 day or 30 days of history
(see slo/evaluation.py for how the rows stay exact when late events arrive).
"""

from __future__ import annotations

import zoneinfo

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

from deployments.models import Deployment
from evals.models import EvalRun, EvalSet
from inferops.models import Authored
from inferops.timeparse import format_duration
from inferops.validators import slug_validator
from registry.models import RegisteredModel
from slo.choices import MAX_EVAL_EVERY_S, MIN_EVAL_EVERY_S, RATIO_SERIES, Budgeting, Scope, SliKind, SloState, Window

LATENCY_FIELDS = ("ttft_ms", "tpot_ms", "e2e_ms")


class Slo(Authored):
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    description = models.TextField(blank=True)
    owner = models.CharField(max_length=100, blank=True, help_text="Team or person responsible.")
    runbook_url = models.URLField(max_length=500, blank=True)
    scope = models.CharField(max_length=16, choices=Scope.choices, default=Scope.DEPLOYMENT)
    # An SLO of a deployment (or model) that is gone has nothing left to measure: it goes too.
    # Its alerts stay as history; evaluation resolves any left firing (alerts.services).
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.CASCADE, related_name="slos")
    model = models.ForeignKey(RegisteredModel, null=True, blank=True, on_delete=models.CASCADE, related_name="slos")
    tenant = models.CharField(max_length=63, blank=True, validators=[slug_validator])
    sli_kind = models.CharField(max_length=16, choices=SliKind.choices)
    ttft_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0)])
    tpot_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0)])
    e2e_ms = models.FloatField(null=True, blank=True, validators=[MinValueValidator(0)])
    ratio_good = models.CharField(max_length=32, blank=True)
    ratio_total = models.CharField(max_length=32, blank=True)
    # Quality SLIs: the eval set is scored on the deployment every eval_every_s (slo/quality.py); each
    # case is an event, good when it passes. An SLO whose eval set is gone has nothing left to measure.
    eval_set = models.ForeignKey(EvalSet, null=True, blank=True, on_delete=models.CASCADE, related_name="slos")
    eval_every_s = models.PositiveIntegerField(
        null=True, blank=True,
        help_text=f"Quality SLIs: seconds between eval runs, {MIN_EVAL_EVERY_S} to {MAX_EVAL_EVERY_S}.")
    objective = models.FloatField(
        help_text="The fraction of events that must be good (e.g. 0.995). For a quality SLI it is the floor: "
                  "the fraction of eval cases that must pass; the latest run scoring below it pages.")
    window = models.CharField(max_length=16, choices=Window.choices, default=Window.MONTH)
    time_zone = models.CharField(max_length=64, default="UTC")
    budgeting = models.CharField(max_length=16, choices=Budgeting.choices, default=Budgeting.OCCURRENCES)
    timeslice_target = models.FloatField(null=True, blank=True)
    # One minimum for every judgement on this SLO (its budget state, its burn-rate alerts, the
    # rollout gate, degradation), so a low-traffic SLO is never judged by some and not others.
    min_requests = models.PositiveIntegerField(
        default=20, help_text="Minimum events: with fewer in the budget window the SLO reads 'insufficient "
                              "traffic' (never exhausted, gates nothing), and no alert fires while a rule's "
                              "long window has fewer.")
    # Where the SLI data begin: the earliest stored event found when the SLO was created (a
    # back-fill), else the creation time. Null until the first evaluation.
    backfilled_from = models.DateTimeField(null=True, blank=True)
    # Request SLIs: when the back-fill read the stored events (set: the usage pipeline adds each
    # new event into the minutes); ratio SLIs: ReplicaMetricsMinute.start read so far. NULL: to back-fill.
    watermark = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        errors: dict[str, str] = {}
        if self.objective is not None and not 0 < self.objective < 1:
            errors["objective"] = "The objective must lie strictly between 0 and 1 (e.g. 0.995)."
        self._clean_scope(errors)
        self._clean_sli(errors)
        if self.budgeting == Budgeting.TIMESLICES:
            if self.timeslice_target is None:
                errors["timeslice_target"] = "Timeslice budgeting needs a timeslice_target in (0, 1]."
            elif not 0 < self.timeslice_target <= 1:
                errors["timeslice_target"] = "The timeslice target must lie in (0, 1]."
        elif self.timeslice_target is not None:
            errors["timeslice_target"] = "A timeslice_target applies only to timeslice budgeting."
        try:
            zoneinfo.ZoneInfo(self.time_zone or "")
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            errors["time_zone"] = f"Unknown IANA time zone {self.time_zone!r} (e.g. 'Europe/Berlin')."
        if errors:
            raise ValidationError(errors)

    def _clean_scope(self, errors: dict) -> None:
        if self.scope == Scope.DEPLOYMENT:
            if self.deployment_id is None:
                errors["deployment"] = "A deployment-scoped SLO needs a deployment."
            if self.model_id is not None:
                errors["model"] = "A deployment-scoped SLO takes no model."
            if self.tenant:
                errors["tenant"] = "A deployment-scoped SLO takes no tenant; use scope 'tenant'."
        elif self.scope == Scope.MODEL:
            if self.model_id is None:
                errors["model"] = "A model-scoped SLO needs a model."
            if self.deployment_id is not None:
                errors["deployment"] = "A model-scoped SLO covers all deployments of its model; give no deployment."
            if self.tenant:
                errors["tenant"] = "A model-scoped SLO takes no tenant."
        elif self.scope == Scope.TENANT:
            if not self.tenant:
                errors["tenant"] = "A tenant-scoped SLO needs a tenant."
            if self.deployment_id is None:
                errors["deployment"] = "A tenant-scoped SLO needs the deployment the tenant calls."
            if self.model_id is not None:
                errors["model"] = "A tenant-scoped SLO takes no model."

    def _clean_sli(self, errors: dict) -> None:
        thresholds = [name for name in LATENCY_FIELDS if getattr(self, name) is not None]
        if self.sli_kind in (SliKind.LATENCY, SliKind.GOODPUT):
            if not thresholds:
                errors["ttft_ms"] = f"A {self.sli_kind} SLI needs at least one of ttft_ms, tpot_ms, e2e_ms."
        elif thresholds:
            errors[thresholds[0]] = f"Latency thresholds apply only to latency and goodput SLIs, not {self.sli_kind}."
        if self.sli_kind == SliKind.RATIO:
            for name in ("ratio_good", "ratio_total"):
                value = getattr(self, name)
                if value not in RATIO_SERIES:
                    errors[name] = f"Name one of the scraped series {', '.join(RATIO_SERIES)}; got {value!r}."
            if self.ratio_good and self.ratio_good == self.ratio_total:
                errors["ratio_good"] = "The good and total series must differ."
            if self.scope == Scope.TENANT:
                errors["scope"] = "Replica metrics do not know tenants: a ratio SLI needs scope deployment or model."
        elif self.ratio_good or self.ratio_total:
            errors["ratio_good"] = "ratio_good and ratio_total apply only to ratio SLIs."
        self._clean_quality(errors)

    def _clean_quality(self, errors: dict) -> None:
        if self.sli_kind != SliKind.QUALITY:
            if self.eval_set_id is not None:
                errors["eval_set"] = f"An eval set applies only to quality SLIs, not {self.sli_kind}."
            if self.eval_every_s is not None:
                errors["eval_every_s"] = f"An eval schedule applies only to quality SLIs, not {self.sli_kind}."
            return
        if self.eval_set_id is None:
            errors["eval_set"] = "A quality SLI needs the eval set to score."
        if self.eval_every_s is None:
            errors["eval_every_s"] = (f"A quality SLI needs a schedule: how often to score the eval set "
                                      f"(at least {format_duration(MIN_EVAL_EVERY_S)}).")
        elif not MIN_EVAL_EVERY_S <= self.eval_every_s <= MAX_EVAL_EVERY_S:
            errors["eval_every_s"] = (f"From {format_duration(MIN_EVAL_EVERY_S)} to "
                                      f"{format_duration(MAX_EVAL_EVERY_S)} between eval runs; "
                                      f"got {self.eval_every_s} s.")
        if self.scope != Scope.DEPLOYMENT:
            errors["scope"] = (f"A quality SLI scores one deployment's replicas: scope deployment, not {self.scope} "
                               "(an eval run has no tenant, and a model's deployments are scored one by one).")
        if self.budgeting == Budgeting.TIMESLICES:
            errors["budgeting"] = ("A quality SLI budgets eval cases (occurrences): its minutes hold a run now and "
                                   "then, not a steady flow to slice.")

    @property
    def thresholds(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in LATENCY_FIELDS if getattr(self, name) is not None}

    def deployment_names(self) -> list[str]:
        """The deployment names usage events of this SLO carry."""
        if self.scope == Scope.MODEL:
            return list(Deployment.objects.filter(model_id=self.model_id).values_list("name", flat=True))
        return [self.deployment.name] if self.deployment_id else []


class SloEvalRun(models.Model):
    """An eval run of a quality SLO, counted into its minute row: one row per (SLO, run), so a run is
    counted once whoever records it first (the run_finished receiver or the back-fill)."""

    slo = models.ForeignKey(Slo, on_delete=models.CASCADE, related_name="eval_runs")
    run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="+")
    minute = models.DateTimeField(help_text="The minute row it was counted into: the run's finish.")
    good = models.PositiveIntegerField(help_text="Cases passed.")
    total = models.PositiveIntegerField(help_text="Cases scored.")

    class Meta:
        ordering = ["slo", "minute", "run"]
        constraints = [models.UniqueConstraint(fields=["slo", "run"], name="unique_slo_eval_run")]

    def __str__(self) -> str:
        return f"{self.slo_id} run {self.run_id}: {self.good}/{self.total}"


class SloMinute(models.Model):
    """One minute of an SLO's SLI: counts of that minute and running totals up to and including it."""

    # No index of its own: the unique (slo, minute) index leads with slo. A second index on slo
    # alone made the planner walk all of an SLO's rows to find the recent ones.
    slo = models.ForeignKey(Slo, on_delete=models.CASCADE, related_name="minutes", db_index=False)
    minute = models.DateTimeField()
    good = models.BigIntegerField(default=0)
    total = models.BigIntegerField(default=0)
    # Timeslice verdict of the minute (good/total below the slice target); a minute without
    # traffic is good.
    bad_slice = models.BooleanField(default=False)
    cum_good = models.BigIntegerField(default=0)
    cum_total = models.BigIntegerField(default=0)
    cum_bad_slices = models.BigIntegerField(default=0)
    # The usage pipeline added events since the running totals were last derived (slo/usage.py).
    stale = models.BooleanField(default=False, db_default=False)

    class Meta:
        ordering = ["slo", "minute"]
        # The unique index (slo, minute) also serves "the last row at or before t" probes.
        constraints = [models.UniqueConstraint(fields=["slo", "minute"], name="unique_slo_minute")]
        indexes = [models.Index(fields=["slo", "minute"], condition=models.Q(stale=True), name="slo_minute_stale")]

    def __str__(self) -> str:
        return f"{self.slo_id} @ {self.minute:%Y-%m-%d %H:%M}: {self.good}/{self.total}"


class SloStatus(models.Model):
    """The SLO's state at its last evaluation (what the list, the status API and gates read)."""

    slo = models.OneToOneField(Slo, on_delete=models.CASCADE, related_name="status", primary_key=True)
    sli = models.FloatField(null=True, blank=True, help_text="SLI over the window; null without events.")
    good = models.BigIntegerField(default=0)
    total = models.BigIntegerField(default=0)
    budget_total = models.FloatField(default=0, help_text="Allowed bad events (or bad minutes) in the window.")
    budget_consumed = models.FloatField(default=0)
    budget_remaining = models.FloatField(default=1, help_text="Fraction of the budget left; negative when overspent.")
    burn_rates = models.JSONField(default=dict, blank=True)
    time_to_exhaustion_s = models.FloatField(
        null=True, blank=True, help_text="At the 1h burn rate; null when not burning.")
    state = models.CharField(max_length=16, choices=SloState.choices, default=SloState.OK)
    window_start = models.DateTimeField(null=True, blank=True)
    evaluated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "SLO statuses"

    def __str__(self) -> str:
        return f"{self.slo_id}: {self.state}"
