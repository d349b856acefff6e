from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "evals"
    verbose_name = "Eval sets and eval runs"

    def ready(self) -> None:
        from evals import registration, rollout_quality

        registration.connect()
        rollout_quality.register()
