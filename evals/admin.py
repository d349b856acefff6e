from django.contrib import admin

from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.sets import services
from inferops.admin import ServiceAdmin


@admin.register(EvalSet)
class EvalSetAdmin(ServiceAdmin):
    list_display = ["name", "scorer", "updated_at"]
    list_filter = ["scorer"]
    search_fields = ["name", "description"]
    fields = ["name", "scorer", "description", "default_for"]
    filter_horizontal = ["default_for"]
    readonly_after_create = ("name",)

    def create_object(self, request, fields):
        return services.evalset_create(actor=request.user, **fields)

    def update_object(self, request, obj, fields):
        return services.evalset_update(eval_set=obj, actor=request.user, **fields)


@admin.register(EvalSetVersion)
class EvalSetVersionAdmin(ServiceAdmin):
    """Read-only: a version is uploaded as JSONL through the API or the console, and never changes."""

    list_display = ["eval_set", "number", "case_count", "sha256", "created_at"]
    # The file and its cases can run to megabytes; the console and the API show them.
    exclude = ["content", "items"]


@admin.register(EvalRun)
class EvalRunAdmin(ServiceAdmin):
    """Read-only: runs are started and cancelled through the API, the console or the CLI."""

    list_display = ["id", "eval_set", "set_version", "target_kind", "model_version", "status", "score", "created_at"]
    list_filter = ["status", "target_kind", "trigger"]
