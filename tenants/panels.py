"""The deployment page's "who may call it" panel: the active API keys whose scope names the
deployment, and in one line the keys with no scope, which reach every deployment (listing them
there would bury the few that were limited on purpose). Never a secret: only its prefix exists."""

from __future__ import annotations

from django.db.models import Count
from django.template.loader import render_to_string

from tenants.models import ApiKey

KEYS_POSITION = 110  # after the degradation panel (100): who may call it, then what burns
SHOWN = 50  # scoped keys listed; the tenant pages list the rest
TENANTS_SHOWN = 10  # tenants named in the unscoped line


def keys_panel(request, deployment) -> str:
    active = ApiKey.objects.active().select_related("tenant")
    scoped = active.filter(deployments__contains=[deployment.name]).order_by("tenant__name", "name", "prefix")
    scoped_total = scoped.count()
    unscoped = list(active.filter(deployments__len=0).order_by().values("tenant__name")
                    .annotate(keys=Count("id")).order_by("tenant__name"))
    return render_to_string("tenants/_deployment_keys.html", {
        "deployment": deployment, "scoped": list(scoped[:SHOWN]), "scoped_more": max(0, scoped_total - SHOWN),
        "unscoped_tenants": unscoped[:TENANTS_SHOWN], "unscoped_more": max(0, len(unscoped) - TENANTS_SHOWN),
        "unscoped_total": sum(row["keys"] for row in unscoped),
    }, request=request)
