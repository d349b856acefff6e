"""Who may read and who may write every URL of the control plane: one row per URL pattern name.

tests/reliability/test_permissions.py checks the URLconf against it (a URL without a row fails, so does a row
without a URL), sends every URL's reads and writes as anonymous, viewer, operator, admin and a tenant's API key
and compares the answers with it, and makes one successful write per row's write to see its audit event.

A row: Rule(read, write, methods, kind, quiet)
  read     the least role a GET needs, PUBLIC, or None where the URL takes no GET
  write    the least role its writes need, PUBLIC, or None where it takes none
  methods  the write methods it takes ("post" unless said)
  kind     API (401 for a caller without an account, 403 below the role), CONSOLE (a redirect to the login page,
           403 below the role), ADMIN_SITE (Django's admin: superusers only, the rest sent to its login page) or
           OPENAI (OpenAI's Files and Batches API under /v1/: a tenant's API key as `Authorization: Bearer`, the
           role API_KEY; every other caller, signed in or not, gets a 401 OpenAI error, never a login page)
  quiet    why a write records no audit event, where by design it records none
REDIRECTS names the console pages whose GET is a redirect, not the page; ADMIN_MODELS the writes each model's
page in the Django admin allows (the rows of the admin's pages are built from it by admin_table()).
The roles: viewer < operator < admin < superuser (the Django admin). A tenant's API key is for the gateway's /v1
and is no role here at all: it gets what an anonymous caller gets, except on the OPENAI rows, which it alone opens
(API_KEY; the control plane's /v1/files* and /v1/batches*, which the gateway forwards). INTEGRATION: an alert
source's token (alerts.inbound), which no user nor API key has.
"""

from __future__ import annotations

from typing import NamedTuple

PUBLIC, VIEWER, OPERATOR, ADMIN, SUPERUSER = "public", "viewer", "operator", "admin", "superuser"
INTEGRATION = "integration"
API_KEY = "api-key"
API, CONSOLE, ADMIN_SITE, OPENAI = "api", "console", "admin-site", "openai"


class Rule(NamedTuple):
    read: str | None
    write: str | None = None
    methods: tuple[str, ...] = ("post",)
    kind: str = CONSOLE
    quiet: str = ""


def api(read, write=None, *methods, quiet=""):
    return Rule(read, write, methods or (("post",) if write else ()), API, quiet)


def page(read, write=None, quiet=""):
    """A console page: GET shows it, POST submits its form."""
    return Rule(read, write, ("post",) if write else (), CONSOLE, quiet)


def action(role):
    """A console button's target: POST only, at least `role`."""
    return Rule(None, role, ("post",), CONSOLE)


def openai(read, write=None, *methods, quiet=""):
    """OpenAI's Files and Batches API: a tenant's API key (API_KEY) or nothing."""
    return Rule(read, write, methods or (("post",) if write else ()), OPENAI, quiet)


V, OP, A, KEY = VIEWER, OPERATOR, ADMIN, API_KEY
TENANT_WRITE = ("a tenant's API key writes its own files and batches as it sends completions: the rows and the usage "
                "ledger record them, the audit log what users change")

TABLE: dict[str, Rule] = {
    # Sign-in, health, assets.
    "login": page(PUBLIC, PUBLIC, quiet="signing in changes nothing of the control plane's"),
    "logout": Rule(None, PUBLIC, ("post",), CONSOLE, quiet="signing out changes nothing of the control plane's"),
    "healthz": api(PUBLIC),
    "favicon": page(PUBLIC),
    "plotly-js": page(PUBLIC),
    "metrics": api(V),
    # The API's description, no data in it (drf-spectacular's SERVE_PERMISSIONS: anyone).
    "schema": api(PUBLIC),
    "api-docs": api(PUBLIC),
    # Console pages.
    "home": page(V),
    "audit": page(A),
    "users": page(A, A),
    "user-role": action(A),
    "user-deactivate": action(A),
    "model-compare": page(V),
    "registry:model-list": page(V),
    "registry:model-detail": page(V),
    "registry:version-new": action(OP),
    "registry:version-detail": page(V),
    "registry:alias-move": action(OP),
    "deployments:list": page(V),
    "deployments:create": page(OP, OP),
    "deployments:detail": page(V),
    "deployments:live": page(V),
    "deployments:edit": page(OP, OP),
    "deployments:rollout-start": action(OP),
    "deployments:rollout-undo": action(OP),
    "deployments:rollout": page(V),
    "deployments:rollout-promote": action(OP),
    "deployments:rollout-promote-full": action(OP),
    "deployments:rollout-abort": action(OP),
    "deployments:rollout-retry": action(OP),
    "deployments:rollout-auto-rollback-on": action(OP),
    "deployments:rollout-auto-rollback-off": action(OP),
    "degradation:policy": action(OP),
    "degradation:override": action(OP),
    "degradation:override-clear": action(OP),
    "tenants:list": page(V, OP),
    "tenants:detail": page(V, OP),
    "tenants:limits": action(OP),
    "tenants:key-revoke": action(OP),
    "slo:list": page(V),
    "slo:create": page(OP, OP),
    "slo:detail": page(V),
    "slo:edit": page(OP, OP),
    "slo:by-name": page(V),
    "evals:set-list": page(V),
    "evals:set-new": action(OP),
    "evals:set-detail": page(V),
    "evals:version-new": action(OP),
    "evals:run-list": page(V),
    "evals:run": page(V),
    "evals:run-cancel": action(OP),
    "alerts:list": page(V),
    # The link in a notification: no sign-in, the signed token is the credential (alerts.services.ack_token).
    "alerts:ack-link": page(PUBLIC, PUBLIC),
    "alerts:integrations": page(A, A),
    "alerts:integration-deactivate": action(A),
    "alerts:silence-list": page(V),
    "alerts:silence-new": page(OP, OP),
    "alerts:silence-edit": page(OP, OP),
    "alerts:silence-expire": action(OP),
    "alerts:detail": page(V),
    "alerts:acknowledge": action(OP),
    "alerts:resolve": action(OP),
    "alerts:snooze": action(OP),
    "alerts:comment": action(OP),
    "alerts:schedule-list": page(V),
    "alerts:schedule-new": page(OP, OP),
    "alerts:schedule-detail": page(V),
    "alerts:schedule-edit": page(OP, OP),
    "alerts:schedule-delete": action(OP),
    "alerts:schedule-override-add": action(OP),
    "alerts:schedule-override-delete": action(OP),
    "alerts:routes": page(V),
    "alerts:route-new": page(OP, OP),
    "alerts:route-edit": page(OP, OP),
    "alerts:route-delete": action(OP),
    "alerts:policies": page(V),
    "alerts:policy-new": page(OP, OP),
    "alerts:policy-edit": page(OP, OP),
    "alerts:policy-delete": action(OP),
    "alerts:receivers": page(A),
    "alerts:receiver-new": page(A, A),
    "alerts:receiver-edit": page(A, A),
    "alerts:receiver-delete": action(A),
    "costs": page(V),
    "costing:report": page(V),
    "costing:prices": page(V, OP),
    "costing:price-delete": action(OP),
    "costing:budgets": page(V, OP),
    "costing:export": page(V),
    "batch-list": page(V),
    "batch-detail": page(V, OP),  # its POST cancels the batch
    "batch-file-download": page(V),
    # OpenAI's Files and Batches API (the gateway forwards /v1/files* and /v1/batches* here).
    "openai-files": openai(KEY, KEY, quiet=TENANT_WRITE),
    "openai-file": openai(KEY, KEY, "delete", quiet=TENANT_WRITE),
    "openai-file-content": openai(KEY),
    "openai-batches": openai(KEY, KEY, quiet=TENANT_WRITE),
    "openai-batch": openai(KEY),
    "openai-batch-cancel": openai(None, KEY, quiet=TENANT_WRITE),
    # The REST API.
    "api-audit-list": api(A),
    "api-model-list": api(V, OP),
    "api-model-detail": api(V, OP, "patch"),
    "api-version-list": api(V, OP),
    "api-version-detail": api(V),
    "api-alias-list": api(V),
    "api-alias-detail": api(V, OP, "put", "delete"),
    "api-prometheus-sd": api(V),
    "api-deployment-list": api(V, OP),
    "api-deployment-detail": api(V, OP, "patch", "delete"),
    "api-deployment-replicas": api(V),
    "api-deployment-metrics": api(V),
    "api-deployment-cold-starts": api(V),
    "api-rollout-list": api(V, OP),
    "api-rollout-undo": api(None, OP),
    "api-rollout-detail": api(V, OP, "patch"),
    "api-rollout-promote": api(None, OP),
    "api-rollout-abort": api(None, OP),
    "api-rollout-retry": api(None, OP),
    "api-degradation": api(V, OP, "put"),
    "api-degradation-override": api(None, OP, "post", "delete"),
    "api-evalset-list": api(V, OP),
    "api-evalset-detail": api(V, OP, "patch"),
    "api-evalset-version-list": api(V, OP),
    "api-evalset-version-detail": api(V),
    "api-eval-run-list": api(V, OP),
    "api-eval-run-detail": api(V),
    "api-eval-run-cases": api(V),
    "api-eval-run-cancel": api(None, OP),
    "api-slo-list": api(V, OP),
    "api-slo-detail": api(V, OP, "patch", "delete"),
    "api-slo-status": api(V),
    "api-slo-history": api(V),
    "api-slo-eval-runs": api(V),
    "api-slo-import": api(None, OP),
    "api-slo-openslo": api(V),
    "api-slo-prometheus-rules": api(V),
    "api-alert-list": api(V),
    "api-alertmanager-receiver": api(None, INTEGRATION),
    "api-alert-detail": api(V),
    "api-alert-ack": api(None, OP),
    "api-alert-resolve": api(None, OP),
    "api-alert-snooze": api(None, OP),
    "api-alert-comments": api(V, OP),
    "api-receiver-list": api(A, A),
    "api-receiver-detail": api(A, A, "patch", "delete"),
    "api-receiver-deliveries": api(A),
    "api-integration-list": api(A, A),
    "api-integration-detail": api(A, A, "delete"),
    "api-silence-list": api(V, OP),
    "api-silence-detail": api(V, OP, "delete"),
    "api-route-list": api(V, OP),
    "api-route-detail": api(V, OP, "patch", "put", "delete"),
    "api-policy-list": api(V, OP),
    "api-policy-detail": api(V, OP, "put", "delete"),
    "api-schedule-list": api(V, OP),
    "api-schedule-detail": api(V, OP, "put", "delete"),
    "api-schedule-on-call": api(V),
    "api-schedule-shifts": api(V),
    "api-schedule-overrides": api(None, OP),
    "api-schedule-override-detail": api(None, OP, "delete"),
    "api-tenant-list": api(V, OP),
    "api-tenant-detail": api(V, OP, "patch"),
    "api-key-list": api(V, OP),
    "api-key-detail": api(V, OP, "delete"),
    "api-usage": api(V),
    "api-costing-prices": api(V, OP),
    "api-costing-price": api(V, OP, "delete"),
    "api-costing-list-prices": api(V, OP),
    "api-costing-budgets": api(V, OP),
    "api-costing-budget": api(V, OP, "patch", "delete"),
    "api-costing-report": api(V),
    "api-model-compare": api(V),
    # Capacity planning (issue 42).
    "api-capacity-curves": api(V, OP),
    "api-capacity-curve": api(V),
    "api-capacity-plan": api(V),
    "api-capacity-runs": api(V, OP),
    "api-capacity-run": api(V),
    "capacity-run-start": action(OP),
    "api-autoscaling": api(V, OP, "put"),
    "api-autoscaling-decisions": api(V),
    "autoscaling-edit": action(OP),
}

# Console pages whose GET answers with a redirect, not a page, for whoever may read them.
REDIRECTS = {"slo:by-name": "links sent before SLO pages were addressed by id: sent on to the page by id",
             "admin:login": "a signed-in superuser is sent on to the admin's index"}

# The Django admin (superusers only). Its own pages, then each registered model's five pages; a model's row
# names the writes its ModelAdmin allows, each through one audited service (users, groups and API tokens: Django's
# own pages, audited by inferops.admin.AuditedAdmin). () is a read-only page: those rows change through the API,
# the console or the platform's own tasks.
ADMIN_PAGES = ("admin:index", "admin:login", "admin:logout", "admin:password_change", "admin:password_change_done",
               "admin:jsi18n", "admin:view_on_site", "admin:autocomplete", "admin:app_list")
ADMIN_MODEL_PAGES = ("changelist", "add", "history", "delete", "change")
ADMIN_MODELS: dict[str, tuple[str, ...]] = {
    "inferops.auditevent": (),
    "auth.user": ("add", "change", "delete"),
    "auth.group": ("add", "change", "delete"),
    "authtoken.tokenproxy": ("add", "change", "delete"),
    "registry.registeredmodel": ("add", "change"),
    "registry.modelversion": (),
    "registry.alias": ("add", "change", "delete"),
    "deployments.deployment": ("change", "delete"),
    "deployments.rollout": (),
    "deployments.replica": (),
    "degradation.degradationpolicy": (),
    "degradation.degradationstate": (),
    "degradation.levelchange": (),
    "tenants.tenant": ("add", "change"),
    "tenants.apikey": (),
    "tenants.usageminute": (),
    "slo.slo": ("add", "change", "delete"),
    "slo.slostatus": (),
    "evals.evalset": ("add", "change"),
    "evals.evalsetversion": (),
    "evals.evalrun": (),
    "alerts.alert": (),
    "alerts.receiver": ("add", "change", "delete"),
    "alerts.notification": (),
    "alerts.delivery": (),
    "costing.price": (),
    "costing.listprice": (),
    "costing.budget": (),
    "costing.replicalife": (),
    "costing.costhour": (),
    "costing.closedmonth": (),
    "costing.adjustment": (),
    "batches.batch": (),
    "batches.batchfile": (),
}


def admin_table() -> dict[str, Rule]:
    rows = {name: Rule(SUPERUSER, None, (), ADMIN_SITE) for name in ADMIN_PAGES}
    rows["admin:login"] = Rule(PUBLIC, PUBLIC, ("post",), ADMIN_SITE, quiet="signing in")
    for label in ADMIN_MODELS:
        app, model = label.split(".")
        for kind in ADMIN_MODEL_PAGES:
            rows[f"admin:{app}_{model}_{kind}"] = Rule(SUPERUSER, None, (), ADMIN_SITE)
    rows["admin:auth_user_password_change"] = Rule(SUPERUSER, None, (), ADMIN_SITE)
    return rows
