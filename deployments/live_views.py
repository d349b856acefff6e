"""The deployment page's live state: its header, status and replica table as JSON, which the page
polls every few seconds and writes in place (the page itself renders the same figures at load)."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.views.decorators.cache import never_cache

from deployments.api import DeploymentSerializer, deployment_queryset
from deployments.choices import ReplicaState

# As many replicas as the page lists.
MAX_REPLICAS = 50


def replica_row(replica) -> dict:
    started = timezone.localtime(replica.started_at) if replica.started_at else None
    return {
        "id": replica.pk, "version": replica.version.number, "state": replica.state,
        "crash_looping": replica.crash_looping, "url": replica.url, "restarts": replica.restarts,
        # Formatted as the page formats them, so a refreshed row reads like a rendered one.
        "started": date_format(started, "H:i:s") if started else "",
        "started_at": started.isoformat() if started else None,
        "last_error": replica.last_error,
    }


def live_state(deployment, *, show_all: bool = False) -> dict:
    """What the header and the replica table show. Ready counts come from the replica rows themselves,
    so a replica marked ready shows at the next poll, whatever the last reconcile wrote."""
    summary = DeploymentSerializer(deployment).data
    replicas = deployment.replica_set.select_related("version").order_by("-id")
    if not show_all:
        replicas = replicas.exclude(state=ReplicaState.STOPPED)
    return {
        "name": deployment.name, "status": summary["status"], "status_message": summary["status_message"],
        "version": summary["version"], "alias": summary["alias"], "ready_replicas": summary["ready_replicas"],
        "replicas": summary["replicas"], "up_to_date": summary["up_to_date"], "paused": summary["paused"],
        "replica_rows": [replica_row(r) for r in replicas[:MAX_REPLICAS]],
        "at": timezone.now().isoformat(),
    }


@never_cache
@login_required
def deployment_live(request, name: str):
    deployment = get_object_or_404(deployment_queryset(), name=name)
    return JsonResponse(live_state(deployment, show_all=request.GET.get("replicas") == "all"))
