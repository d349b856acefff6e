from django.contrib import admin

from inferops.admin import ServiceAdmin
from slo import services
from slo.models import Slo, SloStatus


@admin.register(Slo)
class SloAdmin(ServiceAdmin):
    list_display = ["name", "scope", "deployment", "sli_kind", "objective", "window", "budgeting", "updated_at"]
    list_filter = ["sli_kind", "window", "budgeting", "scope"]
    search_fields = ["name", "description", "owner"]
    exclude = ["created_by", "backfilled_from", "watermark"]  # set by the service and by evaluation

    def create_object(self, request, fields):
        return services.slo_create(actor=request.user, **fields)

    def update_object(self, request, obj, fields):
        return services.slo_update(slo=obj, actor=request.user, **fields)

    def delete_object(self, request, obj):
        services.slo_delete(slo=obj, actor=request.user)


@admin.register(SloStatus)
class SloStatusAdmin(ServiceAdmin):
    """Read-only: written by evaluation alone."""

    list_display = ["slo", "state", "sli", "budget_remaining", "evaluated_at"]
    list_filter = ["state"]
