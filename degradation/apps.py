from django.apps import AppConfig


class DegradationConfig(AppConfig):
    name = "degradation"
    verbose_name = "Graceful degradation"

    def ready(self) -> None:
        # The policy engine runs after each SLO evaluation cycle, on the burn rates it just computed
        # (its policies' windows included); slo announces the cycle instead of importing this app.
        from alerts import panels as alert_panels
        from degradation import alert_panels as degradation_alert_panels
        from degradation import engine, panels
        from deployments import panels as deployment_panels
        from slo import signals

        signals.cycle_evaluated.connect(engine.on_cycle_evaluated, dispatch_uid="degradation-engine")
        if engine.policy_windows not in signals.burn_windows:
            signals.burn_windows.append(engine.policy_windows)
        # The deployment and alert pages show where its degradation stands; neither app can import this one.
        deployment_panels.register(panels.degradation_panel)
        alert_panels.register(degradation_alert_panels.degradation_panel, alert_panels.DEGRADATION)
