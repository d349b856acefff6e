from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, API keys and usage"

    def ready(self) -> None:
        # The deployment page lists the keys that may call it; deployments cannot import tenants.
        from deployments import panels as deployment_panels
        from tenants import panels

        deployment_panels.register(panels.keys_panel, panels.KEYS_POSITION)
