import os

from celery import Celery
from celery.signals import task_failure
from redis.exceptions import RedisError

from inferops.redis_client import redis_client

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("inferops")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def enqueue(task_name: str, *args, **options) -> None:
    """Queue a task by its registered name, for a caller that must not import the module defining it
    (that module imports the caller: an import cycle). Like `.delay()`, it honours task_always_eager."""
    app.signature(task_name, args=args).apply_async(**options)


# Failed tasks by name, read by the control plane's /metrics (project/metrics.py says why Redis).
TASK_FAILURES_KEY = "inferops:celery:task_failures"


@task_failure.connect
def count_task_failure(sender=None, **_) -> None:
    try:
        redis_client().hincrby(TASK_FAILURES_KEY, getattr(sender, "name", str(sender)), 1)
    except (RedisError, OSError):
        pass  # a Redis outage loses the count rather than failing the worker
