"""Celery tasks of the evals app: thin wrappers that take ids and call one function."""

from celery import shared_task

from evals.runs import runner


@shared_task(name="evals.execute_run", ignore_result=True)
def execute_run(run_id: int) -> str:
    """Score one run (enqueued by evals.runs.services.run_create once its row is committed)."""
    return runner.execute_run(run_id)


@shared_task(name="evals.reap_runs", ignore_result=True)
def reap_runs() -> int:
    """Beat task (every minute): fail the running runs whose worker stopped beating."""
    return len(runner.reap_stale_runs())
