from django.apps import AppConfig


class DegradationConfig(AppConfig):
    name = "degradation"
    verbose_name = "Graceful degradation"

    def ready(self) -> None:
        # The policy engine runs in the SLO evaluation cycle, on the burn rates it just folded in;
        # slo announces the cycle instead of importing this app (which depends on slo).
        from alerts import panels as alert_panels
        from degradation import alert_panels as degradation_alert_panels
        from degradation import engine, panels
        from deployments import panels as deployment_panels
        from slo.evaluation import cycle_evaluated

        cycle_evaluated.connect(engine.on_cycle_evaluated, dispatch_uid="degradation-engine")
        # The deployment and alert pages show where its degradation stands; neither app can import this one.
        deployment_panels.register(panels.degradation_panel)
        alert_panels.register(degradation_alert_panels.degradation_panel, alert_panels.DEGRADATION)
