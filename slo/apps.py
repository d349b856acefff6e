from django.apps import AppConfig


class SloConfig(AppConfig):
    name = "slo"
    verbose_name = "SLOs and error budgets"

    def ready(self) -> None:
        # Rollouts are judged on SLOs, which are defined on deployments: deployments calls this
        # through the interface it defines instead of importing slo (no app cycle). The alert page
        # shows the SLO's burn the same way: alerts is a lower layer.
        from alerts import panels as alert_panels
        from deployments import overview
        from deployments.rollouts import gate as rollout_gate
        from evals.signals import run_finished
        from inferops import usage_pipeline
        from inferops.panels import home_panels
        from slo import panels, quality, usage
        from slo.alert_panels import slo_panel
        from slo.rollout_gate import SloRolloutGate

        rollout_gate.register(SloRolloutGate())
        alert_panels.register(slo_panel, alert_panels.SLO)
        # The deployment list and the home page show each deployment's SLO state the same way.
        overview.register_slo_states(panels.deployment_slo_states)
        home_panels.register(panels.home_panel, panels.SLOS)
        # Each new usage event is judged once, at ingest, into the SLO minutes (costing reads the verdict).
        usage_pipeline.register(usage.fold_events, stage=usage_pipeline.JUDGE)
        # A quality SLO's scheduled eval run counts its cases into the SLO's minutes when it finishes.
        run_finished.connect(quality.on_run_finished, dispatch_uid="slo.quality.on_run_finished")
