from django.contrib import admin

from costing.models import Adjustment, Budget, ClosedMonth, CostHour, ListPrice, Price, ReplicaLife


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin):
    list_display = ["resource", "tier", "usd_per_hour", "effective_from", "effective_to", "created_by"]
    list_filter = ["tier", "resource"]

    def has_change_permission(self, request, obj=None):
        return False  # through the API or the console, which check overlaps and closed months


@admin.register(ListPrice)
class ListPriceAdmin(admin.ModelAdmin):
    list_display = ["deployment", "tenant", "usd_per_mtok_prompt", "usd_per_mtok_completion", "effective_from"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["tenant", "deployment", "monthly_usd", "thresholds", "updated_at"]


@admin.register(ReplicaLife)
class ReplicaLifeAdmin(admin.ModelAdmin):
    list_display = ["deployment", "version", "replica_ref", "node", "started_at", "ended_at", "cpus", "gpu_count"]
    list_filter = ["deployment", "driver"]

    def has_change_permission(self, request, obj=None):
        return False  # written by the ledger task only


@admin.register(CostHour)
class CostHourAdmin(admin.ModelAdmin):
    list_display = ["hour", "deployment", "version", "life", "minutes", "usd"]
    list_filter = ["deployment"]

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(ClosedMonth)
class ClosedMonthAdmin(admin.ModelAdmin):
    list_display = ["month", "closed_at"]

    def has_change_permission(self, request, obj=None):
        return False  # frozen


@admin.register(Adjustment)
class AdjustmentAdmin(admin.ModelAdmin):
    list_display = ["booked_month", "source_month", "tenant", "deployment", "version", "usd"]

    def has_change_permission(self, request, obj=None):
        return False
