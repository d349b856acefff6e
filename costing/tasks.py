"""Celery tasks of the costing app: thin, each loads nothing but ids and calls a service."""

from __future__ import annotations

from datetime import datetime

from celery import shared_task
from django.utils import timezone

from costing import services
from costing.ledger import floor_hour


@shared_task(name="costing.sync_ledger", ignore_result=True)
def sync_ledger() -> dict:
    """Beat (every minute): record replica runs, price them, roll up usage; then book late data
    for closed months as adjustments. Under an advisory lock: a second run at once is skipped."""
    return services.ledger_sync_and_book(now=timezone.now())


@shared_task(name="costing.rebuild_costs", bind=True, ignore_result=True, max_retries=20)
def rebuild_costs(self, start_iso: str) -> dict:
    """After a price that starts in the past: rewrite the cost rows from its start on."""
    from costing.ledger import LOCK_NAMESPACE, costs_compute, ledger_through
    from inferops.locks import try_advisory_lock

    start = floor_hour(datetime.fromisoformat(start_iso))
    with try_advisory_lock(LOCK_NAMESPACE) as acquired:
        if not acquired:  # the minute's sync holds the ledger: try again shortly
            raise self.retry(countdown=5)
        through = ledger_through()
        if through is None or start >= through:
            return {"rows": 0}
        return {"rows": costs_compute(start, through)}


@shared_task(name="costing.close_months", ignore_result=True)
def close_months() -> list[str]:
    """Beat (hourly; on the 1st it finds last month): freeze each finished month not yet closed."""
    now = timezone.now()
    closed = []
    for month in services.months_to_close(now):
        services.month_close(month=month, now=now)
        closed.append(month.strftime("%Y-%m"))
    return closed


@shared_task(name="costing.evaluate_budgets", ignore_result=True)
def evaluate_budgets() -> dict:
    """Beat (every 5 minutes) and after a budget changes: budget alerts opened or resolved."""
    changes = services.budgets_evaluate(now=timezone.now())
    return dict(changes.__dict__)
