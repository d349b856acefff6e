"""The tenant page's batches panel: the tenant's latest batches with their progress, ETA and cost so
far, and a link to all of them.

Registered on inferops.panels.tenant_panels from BatchesConfig.ready: tenants sits below batches and
cannot import it.
"""

from __future__ import annotations

from django.template.loader import render_to_string

from batches.views import batch_queryset, batch_rows

TENANT_BATCHES = 50  # after what tenants' own page shows first
LATEST = 10


def tenant_batches_panel(request, tenant) -> str:
    batches = list(batch_queryset().filter(tenant=tenant).order_by("-created_at", "-id")[:LATEST + 1])
    return render_to_string("batches/_tenant_panel.html", {
        "tenant": tenant, "rows": batch_rows(batches[:LATEST]), "more": len(batches) > LATEST, "hide_tenant": True,
    }, request=request)
