from django.contrib import admin

from slo.models import Slo, SloStatus


@admin.register(Slo)
class SloAdmin(admin.ModelAdmin):
    list_display = ["name", "scope", "deployment", "sli_kind", "objective", "window", "budgeting", "updated_at"]
    list_filter = ["sli_kind", "window", "budgeting", "scope"]
    search_fields = ["name", "description", "owner"]
    readonly_fields = ["backfilled_from", "watermark"]


@admin.register(SloStatus)
class SloStatusAdmin(admin.ModelAdmin):
    list_display = ["slo", "state", "sli", "budget_remaining", "evaluated_at"]
    list_filter = ["state"]

    def has_change_permission(self, request, obj=None):
        return False  # written by evaluation only
