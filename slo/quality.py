"""Quality SLOs: a deployment scored on an eval set on a schedule, each run's cases counted into the
SLO's minutes, and a page when the latest run scores below the floor (the SLO's objective).

- Schedule (`start_due_runs`, beat every minute): an eval run (trigger "slo") for each (deployment,
  eval set) of a quality SLO whose last scheduled run started eval_every_s ago or longer and none is
  queued or running. One tick at a time (an advisory lock); a second tick, even right after, finds
  the run it started still queued and starts none.
- Recording (`on_run_finished`, evals.signals.run_finished): a succeeded run counts its cases into
  the minute row at its finish (good = passed, total = cases) of every quality SLO on that deployment
  and eval set, through the usage pipeline's `add_minutes`, so budgets, windows and charts read them
  like request events. A SloEvalRun row per (SLO, run) makes that once: the receiver and the back-fill
  of a new or redefined SLO (`backfill_runs`) may meet a run, and only the first counts it.
- Verdict (`with_verdicts`): the evaluation cycle attaches each quality SLO's latest counted run; the
  alerts page on it when it scores below the floor and resolve when a later run is back at or above.
  A quality drop is a level, not a rate: no burn-rate rule fires on a quality SLO.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Count, Exists, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from evals.choices import RunStatus, Trigger
from evals.models import EvalCaseResult, EvalRun
from evals.runs.services import run_create
from inferops.celery import enqueue
from inferops.locks import LockId, try_advisory_lock
from inferops.timeparse import format_duration
from slo.budget import floor_minute
from slo.choices import SliKind
from slo.models import Slo, SloEvalRun
from slo.usage import FOLD_LOCK, add_minutes

log = logging.getLogger(__name__)

# Key 2 of the evaluation's namespace (key 1 is FOLD_LOCK): one scheduling tick at a time.
SCHEDULE_LOCK_KEY = 2
IN_FLIGHT = (RunStatus.QUEUED, RunStatus.RUNNING)
# The console page of a run, with its failing cases (evals/runs/urls.py).
RUN_PAGE = "/evals/runs/{}/"
# Quality SLOs on a run's deployment and eval set, locked FOR KEY SHARE: an SLO redefined or deleted
# meanwhile waits for this transaction, and one redefined before it no longer matches.
_COVERING_RUN = f"""
    SELECT id FROM slo_slo WHERE sli_kind = '{SliKind.QUALITY}' AND deployment_id = %s AND eval_set_id = %s
    ORDER BY id FOR KEY SHARE
"""
_COUNT_RUNS = """
    INSERT INTO slo_sloevalrun (slo_id, run_id, minute, good, total)
    SELECT * FROM unnest(%s::int8[], %s::int8[], %s::timestamptz[], %s::int8[], %s::int8[])
    ON CONFLICT (slo_id, run_id) DO NOTHING
    RETURNING slo_id, minute, good, total
"""


def run_url(run_id: int) -> str:
    return f"{settings.INFEROPS_EXTERNAL_URL}{RUN_PAGE.format(run_id)}"


# ---------------------------------------------------------------------------- schedule


def scheduled_runs():
    """The runs a quality SLO's schedule started on the outer SLO's deployment and eval set."""
    return EvalRun.objects.filter(trigger=Trigger.SLO, deployment=OuterRef("deployment"),
                                  eval_set=OuterRef("eval_set"))


def due_slos(now: datetime) -> list[Slo]:
    """Quality SLOs whose pair (deployment, eval set) has no run in flight and whose last scheduled
    run started at least eval_every_s ago (a run cancelled before it started: when it was queued)."""
    last = scheduled_runs().order_by("-created_at", "-id").annotate(
        at=Coalesce("started_at", "created_at")).values("at")[:1]
    slos = (Slo.objects.filter(sli_kind=SliKind.QUALITY, deployment__deleted_at=None, eval_set__isnull=False)
            .select_related("deployment", "eval_set")
            .annotate(in_flight=Exists(scheduled_runs().filter(status__in=IN_FLIGHT)), last_started=Subquery(last))
            .order_by("eval_every_s", "pk"))
    return [slo for slo in slos if not slo.in_flight and (
        slo.last_started is None or slo.last_started <= now - timedelta(seconds=slo.eval_every_s))]


def start_due_runs(*, now: datetime | None = None) -> list[EvalRun]:
    """Start the due runs (see due_slos), one per deployment and eval set however many SLOs share
    them; returns them. Nothing while another tick holds the lock."""
    now = now or timezone.now()
    started: list[EvalRun] = []
    with try_advisory_lock(LockId.SLO_EVALUATION, SCHEDULE_LOCK_KEY) as acquired:
        if not acquired:
            return started
        pairs = set()
        for slo in due_slos(now):
            if (slo.deployment_id, slo.eval_set_id) in pairs:
                continue
            pairs.add((slo.deployment_id, slo.eval_set_id))
            try:
                started.append(run_create(eval_set=slo.eval_set, actor=None, trigger=Trigger.SLO,
                                          target={"deployment": slo.deployment.name}))
            except ValidationError as exc:  # e.g. a set with no version yet: tried again next tick
                log.warning("quality SLO %s: no eval run started: %s", slo.name, "; ".join(exc.messages))
    return started


# ---------------------------------------------------------------------------- recording


def count_runs(cursor, pairs: list[tuple[int, EvalRun]]) -> list[int]:
    """Count each (slo id, succeeded run) into the SLO's minute row at the run's finish, unless that
    pair was counted already; returns the SLO id of each pair counted now. The caller holds FOLD_LOCK."""
    runs = {run.pk: run for _, run in pairs}
    cases = dict.fromkeys(runs, (0, 0))
    tallies = (EvalCaseResult.objects.filter(run_id__in=list(runs)).values("run_id")
               .annotate(good=Count("pk", filter=Q(passed=True)), total=Count("pk")))
    cases.update({row["run_id"]: (row["good"], row["total"]) for row in tallies})
    pairs = [(slo_id, run) for slo_id, run in pairs if cases[run.pk][1]]  # no case scored: nothing to count
    if not pairs:
        return []
    cursor.execute(_COUNT_RUNS, [
        [slo_id for slo_id, _ in pairs], [run.pk for _, run in pairs],
        [floor_minute(run.finished_at) for _, run in pairs],
        [cases[run.pk][0] for _, run in pairs], [cases[run.pk][1] for _, run in pairs]])
    counted = cursor.fetchall()
    minutes: dict[tuple[int, float], list[int]] = {}
    for slo_id, minute, good, total in counted:
        sums = minutes.setdefault((slo_id, minute.timestamp()), [0, 0])
        sums[0] += good
        sums[1] += total
    add_minutes(cursor, minutes)
    return [slo_id for slo_id, *_ in counted]


def on_run_finished(sender, run: EvalRun, **kwargs) -> None:
    """evals.signals.run_finished: a scheduled run that succeeded counts into its quality SLOs, which
    are evaluated right after (their page opens or resolves without waiting for the cycle)."""
    if run.trigger != Trigger.SLO or run.status != RunStatus.SUCCEEDED or run.deployment_id is None:
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock_shared(%s, %s)", FOLD_LOCK)
        cursor.execute(_COVERING_RUN, [run.deployment_id, run.eval_set_id])
        slo_ids = [slo_id for (slo_id,) in cursor.fetchall()]
        counted = count_runs(cursor, [(slo_id, run) for slo_id in slo_ids])
        for slo_id in sorted(set(counted)):
            transaction.on_commit(lambda slo_id=slo_id: _evaluate_soon(slo_id))


def _evaluate_soon(slo_id: int) -> None:
    try:
        enqueue("slo.evaluate_slo", slo_id)
    except Exception:  # the broker being down must not fail the run's worker; the cycle catches up
        log.exception("could not enqueue the evaluation of SLO %s", slo_id)


def backfill_runs(cursor, slo: Slo, start: datetime) -> int:
    """A new or redefined quality SLO: count the succeeded scheduled runs of its deployment and eval
    set that finished since `start`. The caller holds FOLD_LOCK exclusively; returns the runs counted."""
    runs = EvalRun.objects.filter(trigger=Trigger.SLO, status=RunStatus.SUCCEEDED, deployment_id=slo.deployment_id,
                                  eval_set_id=slo.eval_set_id, finished_at__gte=start)
    return len(count_runs(cursor, [(slo.pk, run) for run in runs]))


# ---------------------------------------------------------------------------- verdict


@dataclass(frozen=True)
class QualityVerdict:
    """A quality SLO judged on its latest counted run (none yet: nothing to page on)."""

    floor: float
    latest: SloEvalRun | None

    @property
    def score(self) -> float | None:
        return self.latest.good / self.latest.total if self.latest else None

    @property
    def below_floor(self) -> bool:
        return self.latest is not None and self.score < self.floor

    def annotations(self, slo: Slo) -> dict[str, str]:
        """The alert's words: the score, the floor, and the run whose failing cases explain it."""
        if self.latest is None:
            return {"summary": f"Quality SLO {slo.name}: no eval run counted yet",
                    "description": f"No scheduled run of eval set {slo.eval_set.name} on {slo.deployment.name} "
                                   "has succeeded since the SLO was defined.",
                    "floor": f"{self.floor:.4f}"}
        run = self.latest.run
        where = "below" if self.below_floor else "at or above"
        return {
            "summary": f"Quality SLO {slo.name}: eval run {run.pk} scored {self.score:.1%}, {where} the floor "
                       f"{self.floor:.1%}",
            "description": (
                f"quality SLO {slo.name} on deployment {slo.deployment.name}: eval set {slo.eval_set.name} "
                f"v{run.set_version.number}, run {run.pk} finished {run.finished_at:%Y-%m-%d %H:%M:%S} UTC: "
                f"{self.latest.good} of {self.latest.total} cases passed ({self.score:.1%}); the floor is "
                f"{self.floor:.1%} (scored every {format_duration(slo.eval_every_s)}). Failing cases: "
                f"{run_url(run.pk)}"),
            "score": f"{self.score:.4f}",
            "floor": f"{self.floor:.4f}",
            "eval_run": str(run.pk),
            "failing_cases_url": run_url(run.pk),
        }


def latest_counted(slo_ids: list[int]) -> dict[int, SloEvalRun]:
    """Each SLO's latest counted run, by finish."""
    rows = (SloEvalRun.objects.filter(slo_id__in=slo_ids).select_related("run__set_version")
            .order_by("slo_id", "-run__finished_at", "-run_id").distinct("slo_id"))
    return {row.slo_id: row for row in rows}


def with_verdicts(slos: list[Slo], evaluations: list) -> list:
    """The evaluations, each quality SLO's with its verdict (slo.evaluation.Evaluation.quality)."""
    quality = [slo.pk for slo in slos if slo.sli_kind == SliKind.QUALITY]
    if not quality:
        return evaluations
    latest = latest_counted(quality)
    return [dataclasses.replace(ev, quality=QualityVerdict(slo.objective, latest.get(slo.pk)))
            if slo.sli_kind == SliKind.QUALITY else ev for slo, ev in zip(slos, evaluations, strict=True)]


def run_history(slo: Slo, limit: int = 500) -> list[dict]:
    """The SLO's counted runs, oldest first (its last `limit`): the score-per-run chart."""
    rows = list(SloEvalRun.objects.filter(slo=slo).select_related("run__set_version")
                .order_by("-run__finished_at", "-run_id")[:limit])
    return [{"run": row.run_id, "finished_at": row.run.finished_at, "score": row.good / row.total,
             "passed": row.good, "cases": row.total, "set_version": row.run.set_version.number,
             "url": RUN_PAGE.format(row.run_id)} for row in reversed(rows)]
