from django.contrib import admin

from batches.models import Batch, BatchFile


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "model", "endpoint", "status", "total", "completed", "failed", "created_at")
    list_filter = ("status", "endpoint")
    search_fields = ("id", "tenant__name", "model")
    readonly_fields = [f.name for f in Batch._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False  # batches are created through /v1/batches, with an API key


@admin.register(BatchFile)
class BatchFileAdmin(admin.ModelAdmin):
    list_display = ("id", "tenant", "filename", "purpose", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "tenant__name", "filename")
    readonly_fields = [f.name for f in BatchFile._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False
