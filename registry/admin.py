from django.contrib import admin

from registry.models import Alias, AuditEvent, ModelVersion, RegisteredModel


@admin.register(RegisteredModel)
class RegisteredModelAdmin(admin.ModelAdmin):
    list_display = ["name", "task", "owner", "updated_at"]
    search_fields = ["name", "description", "owner"]


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ["model", "number", "architecture", "parameter_count", "dtype", "status", "created_at"]
    list_filter = ["status", "architecture"]
    readonly_fields = ["digest", "manifest"]


@admin.register(Alias)
class AliasAdmin(admin.ModelAdmin):
    list_display = ["model", "name", "version", "updated_at"]


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor_name", "action", "object_repr"]
    list_filter = ["action", "object_type"]

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
