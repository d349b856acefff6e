from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "evals"
    verbose_name = "Eval sets and eval runs"
