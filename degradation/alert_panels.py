"""The degradation panel of the alert page: for an alert whose deployment has a degradation
policy, the level it is at, and for operators the form that forces a level for a time."""

from __future__ import annotations

from django.template.loader import render_to_string

from degradation.api import state_document
from degradation.models import DegradationPolicy
from degradation.panels import action_lines
from degradation.views import OverrideForm
from inferops.roles import OPERATOR, has_role


def degradation_panel(request, alert) -> str:
    name = alert.labels.get("deployment")
    policy = (DegradationPolicy.objects.select_related("deployment").filter(deployment__name=name).first()
              if name else None)
    if policy is None:
        return ""
    state = state_document(policy.deployment, policy)
    return render_to_string("degradation/_alert_panel.html", {
        "deployment": policy.deployment, "policy": policy, "state": state, "actions": action_lines(state["actions"]),
        "override_form": has_role(request.user, OPERATOR) and OverrideForm(policy),
        "back": request.get_full_path(),
    }, request=request)
