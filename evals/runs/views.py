"""Console pages of eval runs: a run (progress that refreshes while it works, scores per scorer, the
failing cases first with what was expected and why they failed, a cancel button) and recent runs."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from evals.choices import FINISHED_RUN, Scorer
from evals.models import EvalRun, EvalSet
from evals.runs import services
from evals.runs.api import run_queryset, run_target
from inferops.api import Conflict
from inferops.roles import require_operator

# Cases listed per table on a run's page; the API pages through all of them.
CASES_SHOWN = 100
RUNS_PER_PAGE = 50


def recent_runs(eval_set: EvalSet | None = None, limit: int = 20):
    """The newest runs (of one set), for evals/_run_table.html wherever a page shows them."""
    runs = run_queryset()
    if eval_set is not None:
        runs = runs.filter(eval_set=eval_set)
    return runs.order_by("-id")[:limit]


def expected_of(case: dict, detail: dict) -> str:
    """What the case wanted, as a person reads it beside the output."""
    scorer = case.get("scorer")
    if scorer in (Scorer.EXACT, Scorer.REGEX):
        return case.get("expected", "")
    if scorer == Scorer.CHOICE and "choices" in case:
        return case["choices"][case["answer"]]
    if scorer == Scorer.SIMILARITY:
        return case.get("reference", "")
    if scorer == Scorer.PARITY:
        return detail.get("reference", "")
    return ""


def case_rows(run: EvalRun, passed: bool) -> tuple[list[dict], int]:
    cases = run.cases.filter(passed=passed).order_by("index")
    items = run.set_version.items
    rows = [{"case": case, "expected": expected_of(items[case.index] if case.index < len(items) else {}, case.detail)}
            for case in cases[:CASES_SHOWN]]
    return rows, cases.count()


@never_cache  # it refreshes itself while the run works (partials/live.html)
@login_required
def run_detail(request, pk: int):
    run = get_object_or_404(run_queryset().select_related("deployment", "rollout"), pk=pk)
    failing, failing_count = case_rows(run, passed=False)
    passing, passing_count = case_rows(run, passed=True)
    return render(request, "evals/run.html", {
        "run": run, "target": run_target(run), "finished": run.status in FINISHED_RUN,
        "percent": round(100 * run.done / run.total) if run.total else 0,
        "scores": sorted(run.scores.items()), "failing": failing, "failing_count": failing_count,
        "passing": passing, "passing_count": passing_count, "cases_shown": CASES_SHOWN,
    })


@never_cache
@login_required
def run_list(request):
    runs = run_queryset().order_by("-id")
    if name := request.GET.get("eval_set"):
        runs = runs.filter(eval_set__name=name)
    page = Paginator(runs, RUNS_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "evals/run_list.html", {"page": page, "runs": page.object_list})


@require_POST
@login_required
def run_cancel(request, pk: int):
    require_operator(request, "Cancelling eval runs")
    run = get_object_or_404(EvalRun, pk=pk)
    try:
        services.run_cancel(run=run, actor=request.user)
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    else:
        messages.success(request, f"Eval run {run.pk}: cancel asked; the cases already scored are kept.")
    return redirect("evals:run", pk=run.pk)
