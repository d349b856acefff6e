import secrets

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db.utils import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.urls import Resolver404, resolve

from inferops.roles import user_role


def body_limit(path: str, default: int) -> int:
    """The largest body `path` takes: `default`, or more where its view takes uploads and says how much
    in `max_body_bytes` (a callable, so tests' settings apply)."""
    try:
        view = resolve(path).func
    except Resolver404:
        return default
    larger = getattr(getattr(view, "cls", view), "max_body_bytes", None)
    return max(default, larger()) if larger is not None else default


class BodySizeLimitMiddleware:
    """Refuse an API body over the limit before anything reads it (413, DRF-style JSON).

    DRF reads the request stream itself, which skips Django's DATA_UPLOAD_MAX_MEMORY_SIZE.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return JsonResponse({"detail": "Content-Length is not a number."}, status=400)
        # Only a body over the usual limit costs a URL lookup.
        if limit is not None and length > limit:
            limit = body_limit(request.path_info, limit)
        if limit is not None and length > limit:
            return JsonResponse(
                {"detail": f"Request body is {length} bytes; the limit is {limit} bytes."},
                status=413,
            )
        return self.get_response(request)


class DatabaseUnavailableMiddleware:
    """When Postgres is down, say so with a 503 instead of a 500 traceback page."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, (OperationalError, InterfaceError)):
            return None
        if request.path.startswith("/api/"):
            return JsonResponse(
                {"detail": "The database is unavailable; retry shortly.", "code": "db_unavailable"},
                status=503,
                headers={"Retry-After": "5"},
            )
        body = render_to_string("db_unavailable.html")
        return HttpResponse(body, status=503, headers={"Retry-After": "5"})


class ContentSecurityPolicyMiddleware:
    """A Content-Security-Policy on every answer: scripts only from this origin or inline with the
    request's nonce (templates write `nonce="{{ csp_nonce }}"`), no plugins, no framing, forms post
    only here. Styles may be inline: plotly writes its own, and pages use style attributes.
    """

    POLICY = ("default-src 'self'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
              "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; object-src 'none'; "
              "base-uri 'self'; form-action 'self'; frame-ancestors 'none'")

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.csp_nonce = secrets.token_urlsafe(16)
        response = self.get_response(request)
        response.headers.setdefault("Content-Security-Policy", self.POLICY.format(nonce=request.csp_nonce))
        return response


class ConsoleRoleMiddleware:
    """A signed-in account with no role (one made in the Django admin without a group) opens no
    console page, as the API refuses it (403): every console view needs at least a viewer. Signing
    in and out, the API, the Django admin (its own staff check) and what probes read stay open."""

    OPEN = ("/api/", "/v1/", "/admin/", "/login/", "/logout/", "/static/", "/assets/", "/healthz", "/metrics",
            "/favicon.ico")

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        user = getattr(request, "user", None)
        if user is None or request.path_info.startswith(self.OPEN):
            return None
        try:
            no_role = user.is_authenticated and user_role(user) is None
        except (OperationalError, InterfaceError):
            return None  # the database is down: the view meets it too, and answers 503 (below)
        if no_role:
            raise PermissionDenied("Your account has no role yet, so it may not open console pages.")
        return None
