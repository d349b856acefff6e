"""The deployment panel of the alert page: for an alert labelled with a deployment, its replicas,
its recent rollouts, and for operators the usual remedies (abort the running rollout, undo the last)."""

from __future__ import annotations

from django.template.loader import render_to_string

from deployments.choices import ACTIVE_ROLLOUT, ReplicaState
from deployments.models import Deployment
from deployments.rollouts.forms import undo_offer

RECENT_ROLLOUTS = 5


def deployment_panel(request, alert) -> str:
    name = alert.labels.get("deployment")
    deployment = (Deployment.objects.select_related("version", "model").filter(name=name).first()
                  if name else None)
    if deployment is None:
        return ""
    replicas = (deployment.replica_set.exclude(state=ReplicaState.STOPPED).select_related("version")
                .order_by("-id")[:20])
    rollouts = list(deployment.rollouts.select_related("stable_version", "candidate_version")
                    .order_by("-id")[:RECENT_ROLLOUTS])
    active = next((r for r in rollouts if r.status in ACTIVE_ROLLOUT), None)
    if active is None:
        active = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
    return render_to_string("deployments/_alert_panel.html", {
        "deployment": deployment, "replicas": replicas, "rollouts": rollouts, "active_rollout": active,
        "undo": undo_offer(deployment, active), "back": request.get_full_path(),
    }, request=request)
