from django.contrib import admin

from inferops.admin import ServiceAdmin
from registry import services
from registry.models import Alias, ModelVersion, RegisteredModel


@admin.register(RegisteredModel)
class RegisteredModelAdmin(ServiceAdmin):
    list_display = ["name", "task", "owner", "updated_at"]
    search_fields = ["name", "description", "owner"]
    fields = ["name", "task", "description", "owner", "tags"]
    readonly_after_create = ("name", "task")

    def create_object(self, request, fields):
        return services.model_create(actor=request.user, **fields)

    def update_object(self, request, obj, fields):
        return services.model_update(model=obj, actor=request.user, **fields)


@admin.register(ModelVersion)
class ModelVersionAdmin(ServiceAdmin):
    """Read-only: a version is registered from its checkpoint through the API or the console."""

    list_display = ["model", "number", "architecture", "parameter_count", "dtype", "status", "created_at"]
    list_filter = ["status", "architecture"]


@admin.register(Alias)
class AliasAdmin(ServiceAdmin):
    list_display = ["model", "name", "version", "updated_at"]
    fields = ["model", "name", "version"]
    readonly_after_create = ("model", "name")  # an alias is moved, not renamed

    def create_object(self, request, fields):
        alias, _ = services.alias_set(actor=request.user, **fields)
        return alias

    def update_object(self, request, obj, fields):
        alias, _ = services.alias_set(model=obj.model, name=obj.name, version=fields.get("version", obj.version),
                                      actor=request.user)
        return alias

    def delete_object(self, request, obj):
        services.alias_delete(alias=obj, actor=request.user)
