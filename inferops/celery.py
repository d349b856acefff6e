import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inferops.settings")

app = Celery("inferops")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def enqueue(task_name: str, *args, **options) -> None:
    """Queue a task by its registered name, for a caller that must not import the module defining it
    (that module imports the caller: an import cycle). Like `.delay()`, it honours task_always_eager."""
    app.signature(task_name, args=args).apply_async(**options)
