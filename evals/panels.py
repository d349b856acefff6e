"""The evals panel of a model version's page: its score on each eval set next to its parent's (the
model's previous version), so "is this version as good?" is answered where the version is shown.

Registered on inferops.panels.version_panels from EvalsConfig.ready: the registry sits below evals
and cannot import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode

from django.db.models import Q
from django.template.loader import render_to_string
from django.urls import reverse

from evals.choices import RunStatus
from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.registration import parent_version
from evals.runs.services import latest_run
from registry.models import ModelVersion

VERSION_SCORES = 10  # first on the version's page


@dataclass
class ScoreRow:
    """One eval set: the version's and its parent's latest succeeded run on the same set version."""

    eval_set: EvalSet
    set_version: EvalSetVersion | None
    run: EvalRun | None
    parent_run: EvalRun | None
    scoring: EvalRun | None  # a queued or running run of the version on this set, shown while there is no score

    @property
    def set_url(self) -> str:
        return reverse("evals:set-detail", args=[self.eval_set.name])

    @property
    def run_url(self) -> str | None:
        return run_url(self.run)

    @property
    def parent_run_url(self) -> str | None:
        return run_url(self.parent_run)

    @property
    def scoring_url(self) -> str | None:
        return run_url(self.scoring)

    @property
    def difference(self) -> float | None:
        if self.run is None or self.parent_run is None or None in (self.run.score, self.parent_run.score):
            return None
        return self.run.score - self.parent_run.score


def run_url(run: EvalRun | None) -> str | None:
    return reverse("evals:run", args=[run.pk]) if run else None


def score_rows(version: ModelVersion, parent: ModelVersion | None) -> list[ScoreRow]:
    """Every eval set that is a default for the model or has scored either version, by name."""
    versions = [v.pk for v in (version, parent) if v is not None]
    scored = (EvalRun.objects.filter(model_version__in=versions, status=RunStatus.SUCCEEDED)
              .values_list("eval_set_id", "set_version_id", "set_version__number", "model_version_id").distinct())
    numbers: dict[int, dict[int, int]] = {}  # set -> set version -> its number
    scored_by: dict[int, set[int]] = {}  # set version -> the versions scored on it
    for set_id, set_version_id, number, version_id in scored:
        numbers.setdefault(set_id, {})[set_version_id] = number
        scored_by.setdefault(set_version_id, set()).add(version_id)
    sets = (EvalSet.objects.filter(Q(default_for=version.model_id) | Q(pk__in=numbers)).distinct()
            .order_by("name"))
    active = {run.eval_set_id: run for run in EvalRun.objects.filter(
        model_version=version, status__in=(RunStatus.QUEUED, RunStatus.RUNNING)).order_by("id")}
    rows = []
    for eval_set in sets:
        set_version = _compared_set_version(eval_set, numbers.get(eval_set.pk, {}), scored_by, version, parent)
        run = latest_run(model_version=version, set_version=set_version) if set_version else None
        parent_run = latest_run(model_version=parent, set_version=set_version) if set_version and parent else None
        rows.append(ScoreRow(eval_set, set_version, run, parent_run, None if run else active.get(eval_set.pk)))
    return rows


def _compared_set_version(eval_set: EvalSet, numbers: dict[int, int], scored_by: dict[int, set[int]],
                          version: ModelVersion, parent: ModelVersion | None) -> EvalSetVersion | None:
    """Scores compare only on one set version: the newest that scored both versions, else the newest
    that scored this one, else the parent, else the set's latest (shown as not scored)."""
    newest_first = sorted(numbers, key=numbers.get, reverse=True)
    wanted = [{version.pk, parent.pk}] if parent else []
    wanted += [{version.pk}] + ([{parent.pk}] if parent else [])
    for needed in wanted:
        if chosen := next((pk for pk in newest_first if needed <= scored_by[pk]), None):
            return EvalSetVersion.objects.get(pk=chosen)
    return eval_set.latest_version()


def compare_url(version: ModelVersion, parent: ModelVersion) -> str:
    """The comparison page of the two versions (costing's page: linked by URL name, evals sits below it)."""
    query = urlencode({"a": parent.number, "b": version.number})
    return f"{reverse('model-compare', args=[version.model.name])}?{query}"


def version_scores_panel(request, version: ModelVersion) -> str:
    parent = parent_version(version)
    return render_to_string("evals/version_panel.html", {
        "version": version, "parent": parent, "rows": score_rows(version, parent),
        "compare_url": compare_url(version, parent) if parent else None,
        "sets_url": reverse("evals:set-list"),
    }, request=request)
