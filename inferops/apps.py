from django.apps import AppConfig


class InferopsConfig(AppConfig):
    name = "inferops"
    verbose_name = "inferops platform"

    def ready(self) -> None:
        # Importing the Celery app here makes `task.delay()` in web processes use the
        # configured broker instead of Celery's default app.
        from inferops import celery  # noqa: F401
