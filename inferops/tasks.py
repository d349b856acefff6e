import time

from celery import shared_task

from inferops import health


@shared_task(name="inferops.tasks.heartbeat")
def heartbeat() -> float:
    """Beat -> worker round trip; the console shows the last one to say the workers live."""
    now = time.time()
    health.record_worker_heartbeat(now)
    return now
