"""Read-only admin pages: prices, list prices and budgets change through the API or the console, whose
services check overlaps and closed months and record each write in the audit log; the ledger's rows are
written by its tasks alone."""

from django.contrib import admin

from costing.models import Adjustment, Budget, ClosedMonth, CostHour, ListPrice, Price, ReplicaLife
from inferops.admin import ServiceAdmin


@admin.register(Price)
class PriceAdmin(ServiceAdmin):
    list_display = ["resource", "tier", "usd_per_hour", "effective_from", "effective_to", "created_by"]
    list_filter = ["tier", "resource"]


@admin.register(ListPrice)
class ListPriceAdmin(ServiceAdmin):
    list_display = ["deployment", "tenant", "usd_per_mtok_prompt", "usd_per_mtok_completion", "batch_discount_percent",
                    "effective_from"]


@admin.register(Budget)
class BudgetAdmin(ServiceAdmin):
    list_display = ["tenant", "deployment", "monthly_usd", "thresholds", "updated_at"]


@admin.register(ReplicaLife)
class ReplicaLifeAdmin(ServiceAdmin):
    list_display = ["deployment", "version", "replica_ref", "node", "started_at", "ended_at", "cpus", "gpu_count"]
    list_filter = ["deployment", "driver"]


@admin.register(CostHour)
class CostHourAdmin(ServiceAdmin):
    list_display = ["hour", "deployment", "version", "life", "minutes", "usd"]
    list_filter = ["deployment"]


@admin.register(ClosedMonth)
class ClosedMonthAdmin(ServiceAdmin):
    list_display = ["month", "closed_at"]


@admin.register(Adjustment)
class AdjustmentAdmin(ServiceAdmin):
    list_display = ["booked_month", "source_month", "tenant", "deployment", "version", "usd"]
