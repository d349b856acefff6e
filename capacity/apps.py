from django.apps import AppConfig


class CapacityConfig(AppConfig):
    name = "capacity"
    verbose_name = "Elastic capacity (autoscaling, scale to zero, capacity planning)"

    def ready(self) -> None:
        # Both register panels on the deployment page (deployments, a lower layer, cannot import them).
        from capacity import panels, planning_panels  # noqa: F401
