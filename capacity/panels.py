"""The autoscaling panel of the deployment page: the policy, where the replica count stands, a chart
of the replicas asked for with every decision and its reason, and for operators the policy form."""

from __future__ import annotations

from datetime import timedelta

from django.template.loader import render_to_string
from django.utils import timezone

from capacity.autoscaling_api import autoscaling_document
from capacity.views import PolicyForm
from deployments.models import Deployment
from deployments.panels import register
from inferops.roles import OPERATOR, has_role

CHART_SPAN = timedelta(hours=6)
AUTOSCALING = 30  # first of the panels: degradation's sits at the default 100


def chart_data(deployment: Deployment) -> dict:
    """Replicas asked for as a step line over the span, and each decision as a point with its reason."""
    now = timezone.now()
    start = now - CHART_SPAN
    decisions = list(deployment.scaling_decisions.filter(at__gte=start).order_by("at", "id"))
    first = decisions[0].from_replicas if decisions else deployment.replicas
    return {
        "x": [start, *(d.at for d in decisions), now],
        "y": [first, *(d.to_replicas for d in decisions), deployment.replicas],
        "decisions": [{"at": d.at, "to": d.to_replicas, "kind": d.get_kind_display(), "reason": d.reason}
                      for d in decisions],
    }


def autoscaling_panel(request, deployment: Deployment) -> str:
    operator = has_role(request.user, OPERATOR)
    doc = autoscaling_document(deployment)
    context = {
        "deployment": deployment, "doc": doc, "chart": chart_data(deployment),
        "form": operator and (getattr(request, "autoscaling_form", None) or PolicyForm(deployment)),
    }
    return render_to_string("capacity/_autoscaling_panel.html", context, request=request)


register(autoscaling_panel, AUTOSCALING)
