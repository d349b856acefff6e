from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import JsonResponse
from django.shortcuts import render

from inferops import health
from inferops.roles import ADMIN, has_role
from registry.models import AuditEvent

# Console sections that later issues fill; until then each says plainly what will be there.
UPCOMING_SECTIONS = {
    "costs": "Costs: price books, usage ledgers and monthly reports per tenant.",
}


@login_required
def upcoming(request, section: str):
    return render(request, "upcoming.html", {"section": section, "about": UPCOMING_SECTIONS[section]})


@login_required
def audit_log(request):
    if not has_role(request.user, ADMIN):
        raise PermissionDenied("The audit log needs the admin role.")
    events = AuditEvent.objects.all()
    if action := request.GET.get("action"):
        events = events.filter(action=action)
    page = Paginator(events, 100).get_page(request.GET.get("page"))
    return render(request, "audit.html", {"page": page, "action": action or ""})


def healthz(request):
    facts = health.status()
    ok = facts["database"] == "ok" and facts["redis"] == "ok"
    return JsonResponse(facts, status=200 if ok else 503)


def plotly_js(request):
    """plotly.js from the installed plotly package: charts work without internet access."""
    from pathlib import Path

    import plotly
    from django.http import FileResponse

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    response = FileResponse(path.open("rb"), content_type="application/javascript")
    response["Cache-Control"] = f"public, max-age={7 * 24 * 3600}"
    return response
