"""Celery tasks of the slo app."""

from __future__ import annotations

from celery import shared_task

from slo.evaluation import evaluate_slos


@shared_task(name="slo.evaluate_slos", ignore_result=True)
def evaluate_slos_task() -> dict:
    """Beat (every minute): one evaluation cycle for all SLOs, under an advisory lock so two
    overlapping runs never interleave (the second returns at once, marked skipped)."""
    return evaluate_slos().as_dict()


@shared_task(name="slo.evaluate_slo", ignore_result=True)
def evaluate_slo_task(slo_id: int) -> dict:
    """Right after a create or an SLI change: back-fill and evaluate that SLO without waiting."""
    return evaluate_slos(slo_ids=[slo_id]).as_dict()


@shared_task(name="slo.prune_minutes", ignore_result=True)
def prune_minutes_task() -> int:
    """Beat (hourly): drop minute rows older than the retention, keeping one anchor per SLO."""
    from slo.evaluation import prune_minutes

    return prune_minutes()
