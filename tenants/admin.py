from django.contrib import admin

from inferops.admin import ServiceAdmin
from tenants import services
from tenants.models import ApiKey, Tenant, UsageMinute


@admin.register(Tenant)
class TenantAdmin(ServiceAdmin):
    list_display = ["name", "display_name", "rpm_limit", "tpm_limit", "max_concurrent", "updated_at"]
    search_fields = ["name", "display_name"]
    fields = ["name", *services.TENANT_FIELDS]
    readonly_after_create = ("name",)

    def create_object(self, request, fields):
        return services.tenant_create(actor=request.user, **fields)

    def update_object(self, request, obj, fields):
        return services.tenant_update(tenant=obj, actor=request.user, **fields)


@admin.register(ApiKey)
class ApiKeyAdmin(ServiceAdmin):
    """Read-only: keys are created and revoked through the API or console, which publish them."""

    list_display = ["prefix", "name", "tenant", "priority", "expires_at", "revoked_at", "created_at"]
    list_filter = ["tenant"]
    exclude = ["key_hash"]


@admin.register(UsageMinute)
class UsageMinuteAdmin(ServiceAdmin):
    """Read-only: the usage ledger is written by ingestion alone."""

    list_display = ["minute", "tenant", "key_prefix", "deployment", "version", "requests", "errors",
                    "prompt_tokens", "completion_tokens"]
    list_filter = ["tenant", "deployment"]
