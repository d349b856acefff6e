import base64

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.cache import never_cache

from inferops import health
from inferops.assets import plotly_bundle
from inferops.models import AuditEvent
from inferops.panels import home_panels
from inferops.roles import ADMIN, has_role


@never_cache  # it refreshes itself (partials/live.html): every fetch must reach the database
@login_required
def home(request):
    """A column of the panels apps register (inferops.panels.home_panels)."""
    return render(request, "home.html", {"panels": home_panels.render(request, None)})


@login_required
def audit_log(request):
    """Every write, newest first, filtered by actor, kind of object, object (name or id) and action."""
    if not has_role(request.user, ADMIN):
        raise PermissionDenied("The audit log needs the admin role.")
    filters = {key: request.GET.get(key, "").strip() for key in ("actor", "object_type", "object", "action")}
    events = AuditEvent.objects.all()
    if filters["actor"]:
        events = events.filter(actor_name__iexact=filters["actor"])
    if filters["object_type"]:
        events = events.filter(object_type=filters["object_type"])
    if filters["object"]:
        events = events.filter(Q(object_repr__icontains=filters["object"]) | Q(object_id=filters["object"]))
    if filters["action"]:
        events = events.filter(action=filters["action"])
    distinct = AuditEvent.objects.order_by()
    return render(request, "audit.html", {
        "page": Paginator(events, 50).get_page(request.GET.get("page")),
        "filters": filters, "filtered": any(filters.values()),
        "actions": distinct.values_list("action", flat=True).distinct().order_by("action"),
        "object_types": distinct.values_list("object_type", flat=True).distinct().order_by("object_type"),
    })


# The console's icon (a 32×32 rounded square in its accent blue, PNG inside an ICO): browsers and
# bookmarks ask for /favicon.ico whatever the page links.
FAVICON = base64.b64decode(
    "AAABAAEAICAAAAAAIACnAAAAFgAAAIlQTkcNChoKAAAADUlIRFIAAAAgAAAAIAgGAAAAc3p69AAAAG5JREFUeJzt17ENwCAQA0C/Z0nJNpmTb"
    "VKyS1JFer2C0iSmsSvgkXwSFYGSbT/OevZlRm+R91SWP3VwNlAhqC6viFhRnsP3KwYYYIABBhhggAEGGGDAz4D6V1Nm9Ba8FyvKgfQESkTu4my"
    "gKAeAC+erIfVtJTasAAAAAElFTkSuQmCC"
)


def favicon(request):
    response = HttpResponse(FAVICON, content_type="image/x-icon")
    response["Cache-Control"] = f"public, max-age={30 * 24 * 3600}, immutable"
    return response


# Paths whose clients read JSON: the REST API, and OpenAI-style clients pointed at the console's port.
JSON_PREFIXES = ("/api/", "/v1/")


def page_not_found(request, exception):
    """The 404 handler: console pages get one in the console's layout, like its 403; the API and
    any client that does not take HTML get DRF's shape (`{"detail": ...}`)."""
    if request.path.startswith(JSON_PREFIXES) or not request.accepts("text/html"):
        return JsonResponse({"detail": f"Not found: nothing at {request.path}."}, status=404)
    return render(request, "404.html", {"request_path": request.path}, status=404)


def healthz(request):
    facts = health.status()
    ok = facts["database"] == "ok" and facts["redis"] == "ok"
    return JsonResponse(facts, status=200 if ok else 503)


def plotly_js(request, digest: str):
    """The console's plotly.js (inferops.assets), so charts work without internet access; gzipped
    for clients that accept it. Its URL names its digest, so browsers keep it for a year; a page
    rendered before an upgrade names the old one and is sent to the current bundle."""
    bundle = plotly_bundle()
    if digest != bundle.digest:
        response = redirect("plotly-js", digest=bundle.digest)
        response["Cache-Control"] = "no-cache"
        return response
    accepts_gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    response = HttpResponse(bundle.gzipped if accepts_gzip else bundle.plain, content_type="application/javascript")
    if accepts_gzip:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["Cache-Control"] = f"public, max-age={365 * 24 * 3600}, immutable"
    return response
