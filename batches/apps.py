from django.apps import AppConfig


class BatchesConfig(AppConfig):
    name = "batches"
    verbose_name = "Offline batches (OpenAI Batch API)"

    def ready(self) -> None:
        from batches import panels
        from inferops.panels import tenant_panels

        # A tenant's page (tenants, a lower layer) lists the tenant's batches.
        tenant_panels.register(panels.tenant_batches_panel, panels.TENANT_BATCHES)
