"""What slo shows on other apps' pages without their importing it: the home page's SLO panel
(every SLO by remaining budget, worst first, with its 1h and 6h burn), and the SLO states the
deployment overview (deployments/overview.py) shows per deployment."""

from __future__ import annotations

from django.db.models import F, Q
from django.template.loader import render_to_string

from slo.api import slo_queryset
from slo.choices import Scope
from slo.models import Slo
from slo.views import budget_percent, burn_text, target_of

SLOS = 30  # home page position: after the alerts and the deployments


def deployment_slo_states(deployments) -> dict[int, list[dict]]:
    """{deployment id: [{pk, name, state, budget_remaining}]} of the SLOs covering each deployment
    (its own, its tenants', and those of its model), in one query."""
    by_model: dict[int, list] = {}
    for deployment in deployments:
        by_model.setdefault(deployment.model_id, []).append(deployment.pk)
    slos = Slo.objects.select_related("status").filter(
        Q(deployment_id__in=[d.pk for d in deployments]) | Q(scope=Scope.MODEL, model_id__in=list(by_model)))
    states: dict[int, list[dict]] = {}
    for slo in slos.order_by("name"):
        status = getattr(slo, "status", None)
        evaluated = status is not None and status.evaluated_at is not None
        entry = {"pk": slo.pk, "name": slo.name, "state": status.state if evaluated else "pending",
                 "budget_remaining": status.budget_remaining if evaluated else None}
        covered = by_model.get(slo.model_id, []) if slo.scope == Scope.MODEL else [slo.deployment_id]
        for deployment_id in covered:
            states.setdefault(deployment_id, []).append(entry)
    return states


def home_panel(request, _obj) -> str:
    """Every SLO, the most burnt first; never-evaluated ones (a full budget) after them, by name."""
    slos = slo_queryset().order_by(F("status__budget_remaining").asc(nulls_last=True), "name")
    rows = []
    for slo in slos:
        status = getattr(slo, "status", None)
        percent = budget_percent(status)
        rows.append({
            "slo": slo, "status": status, "target": target_of(slo), "budget_percent": percent,
            "budget_text": None if percent is None else f"{status.budget_remaining * 100:.1f}%",
            "burn_1h": burn_text(status.burn_rates.get("1h")) if percent is not None else "—",
            "burn_6h": burn_text(status.burn_rates.get("6h")) if percent is not None else "—",
        })
    return render_to_string("slo/_home_slos.html", {"rows": rows}, request=request)
