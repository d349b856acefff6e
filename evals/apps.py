from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "evals"
    verbose_name = "Eval sets and eval runs"

    def ready(self) -> None:
        from evals import panels, registration, rollout_quality
        from inferops.panels import version_panels

        registration.connect()
        rollout_quality.register()
        # A version's page (registry, a lower layer) shows its eval scores against its parent's.
        version_panels.register(panels.version_scores_panel, panels.VERSION_SCORES)
