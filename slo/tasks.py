"""Celery tasks of the slo app."""

from __future__ import annotations

import logging
import time as clock
from datetime import datetime

from celery import shared_task
from django.utils import timezone

from slo import signals
from slo.evaluation import CycleReport, evaluate_slos

log = logging.getLogger(__name__)


def evaluation_cycle(*, now: datetime | None = None) -> CycleReport:
    """One evaluation cycle for all SLOs, then slo.signals.cycle_evaluated with what it found, so the
    apps above slo (the degradation engine) act on the burn rates it just computed."""
    now = now or timezone.now()
    report = evaluate_slos(now=now)
    if report.skipped:
        return report
    started = clock.perf_counter()
    for receiver, outcome in signals.cycle_evaluated.send_robust(sender=evaluation_cycle, now=now,
                                                                 evaluations=report.evaluations):
        if isinstance(outcome, Exception):
            log.error("evaluate-slos: %s failed", receiver, exc_info=outcome)
    report.phases["listeners_s"] = clock.perf_counter() - started
    return report


@shared_task(name="slo.evaluate_slos", ignore_result=True)
def evaluate_slos_task() -> dict:
    """Beat (every minute): one evaluation cycle for all SLOs, under an advisory lock so two
    overlapping runs never interleave (the second returns at once, marked skipped)."""
    return evaluation_cycle().as_dict()


@shared_task(name="slo.evaluate_slo", ignore_result=True)
def evaluate_slo_task(slo_id: int) -> dict:
    """Right after a create or an SLI change: back-fill and evaluate that SLO without waiting."""
    return evaluate_slos(slo_ids=[slo_id]).as_dict()


@shared_task(name="slo.start_quality_runs", ignore_result=True)
def start_quality_runs_task() -> list[int]:
    """Beat (every minute): start the eval runs of the quality SLOs that are due (slo/quality.py)."""
    from slo.quality import start_due_runs

    return [run.pk for run in start_due_runs()]


@shared_task(name="slo.prune_minutes", ignore_result=True)
def prune_minutes_task() -> int:
    """Beat (hourly): drop minute rows older than the retention, keeping one anchor per SLO."""
    from slo.evaluation import prune_minutes

    return prune_minutes()


@shared_task(name="slo.sync_engine_targets", ignore_result=True)
def sync_engine_targets_task() -> dict:
    """Beat (every INFEROPS_SLO_TARGETS_INTERVAL_S), and right after an SLO write: latency targets to
    the built-in replicas and the gateways (slo/engine_targets.py)."""
    from slo.engine_targets import sync_engine_targets

    return sync_engine_targets()
