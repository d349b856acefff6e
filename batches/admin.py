"""Batches and their files in the Django admin: read-only. They are made through /v1 with a tenant's
API key and cancelled from the console or the API (audited); a delete here would pull a batch from
under its runner."""

from django.contrib import admin

from batches.models import Batch, BatchFile
from inferops.admin import ServiceAdmin


@admin.register(Batch)
class BatchAdmin(ServiceAdmin):
    list_display = ("id", "tenant", "model", "endpoint", "status", "total", "completed", "failed", "created_at")
    list_filter = ("status", "endpoint")
    search_fields = ("id", "tenant__name", "model")


@admin.register(BatchFile)
class BatchFileAdmin(ServiceAdmin):
    list_display = ("id", "tenant", "filename", "purpose", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    search_fields = ("id", "tenant__name", "filename")
