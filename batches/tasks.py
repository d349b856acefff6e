"""Celery tasks of the batches app: thin wrappers that take ids and call one function."""

from celery import shared_task

from batches import runner


@shared_task(name="batches.run_batch", ignore_result=True)
def run_batch(batch_id: str) -> str:
    """Validate and run one batch (enqueued when it is created, cancelled, or found without a runner)."""
    return runner.run_batch(batch_id)


@shared_task(name="batches.tick", ignore_result=True)
def tick() -> dict:
    """Beat task: resume the batches whose runner stopped beating."""
    return runner.tick()
