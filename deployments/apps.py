from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        # The alert page shows the alerting deployment's replicas and rollouts; alerts is a lower
        # layer and cannot import this app.
        from alerts import panels as alert_panels
        from deployments.alert_panels import deployment_panel

        alert_panels.register(deployment_panel, alert_panels.DEPLOYMENT)
