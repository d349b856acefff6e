from django.contrib import admin

from deployments import services
from deployments.models import Deployment, Replica, Rollout
from inferops.admin import ServiceAdmin


@admin.register(Deployment)
class DeploymentAdmin(ServiceAdmin):
    """Scale, pause or delete here; deployments are created, and change version, through the API,
    the console or a rollout."""

    list_display = ["name", "model", "version", "replicas", "status", "paused", "updated_at"]
    list_filter = ["status", "driver", "backend"]
    search_fields = ["name"]
    fields = ["name", "model", "version", "replicas", "min_replicas", "max_replicas", "autoscale", "paused",
              "status", "status_message"]
    readonly_fields = ["name", "model", "version", "status", "status_message"]

    def update_object(self, request, obj, fields):
        return services.deployment_update(deployment=obj, actor=request.user, **fields)

    def delete_object(self, request, obj):
        services.deployment_delete(deployment=obj, actor=request.user)


@admin.register(Rollout)
class RolloutAdmin(ServiceAdmin):
    """Read-only: rollouts are started and acted on through the API, the console or the CLI."""

    list_display = ["deployment", "strategy", "status", "weight", "created_at", "finished_at"]
    list_filter = ["status", "strategy"]


@admin.register(Replica)
class ReplicaAdmin(ServiceAdmin):
    """Read-only: the reconcile loop owns replicas."""

    list_display = ["deployment", "version", "state", "node", "url", "restarts", "last_error"]
    list_filter = ["state", "driver"]
