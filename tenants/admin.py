from django.contrib import admin

from tenants.models import ApiKey, Tenant, UsageMinute


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "display_name", "rpm_limit", "tpm_limit", "max_concurrent", "updated_at"]
    search_fields = ["name", "display_name"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Read-only: keys are created and revoked through the API or console, which publish them."""

    list_display = ["prefix", "name", "tenant", "priority", "expires_at", "revoked_at", "created_at"]
    list_filter = ["tenant"]
    exclude = ["key_hash"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(UsageMinute)
class UsageMinuteAdmin(admin.ModelAdmin):
    list_display = ["minute", "tenant", "key_prefix", "deployment", "version", "requests", "errors",
                    "prompt_tokens", "completion_tokens"]
    list_filter = ["tenant", "deployment"]

    def has_change_permission(self, request, obj=None):
        return False
