"""Every URL of the control plane answers each caller as tests/reliability/permissions_table.py says, and every
write it lists leaves an audit event naming who wrote (issue 40).

The callers: anonymous, viewer, operator, admin (a token for the API, a session for the console), a superuser
for the Django admin, and a tenant's API key sent as `Authorization: Bearer <secret>` and as `Token <secret>`,
which the control plane must treat as no credential at all. Requests run in-process, each in a savepoint rolled
back after it, so every one sees the same objects (one of each kind, as tests/test_api_status_matrix.py seeds).
"""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from html.parser import HTMLParser

import pytest
from django.apps import apps
from django.contrib import admin
from django.contrib.auth.models import Group, User
from django.contrib.messages import get_messages
from django.core.files.base import ContentFile
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import transaction
from django.urls import URLResolver, get_resolver
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from alerts.inbound.alertmanager import integration_create
from alerts.models import Alert
from alerts.routing import services as routing_services
from alerts.routing.models import EscalationPolicy, Route
from alerts.services import ack_token
from batches.choices import BatchStatus, FilePurpose
from batches.models import Batch, BatchFile
from batches.services import storage
from capacity.models import CapacityCurve, CapacityRun
from costing import services as costing_services
from deployments.choices import RolloutStatus
from deployments.models import Deployment, Replica, Rollout
from deployments.rollouts import services as rollouts
from evals.runs import services as run_services
from evals.sets import services as set_services
from inferops.assets import plotly_bundle
from inferops.models import AuditEvent
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.reliability.permissions_table import (
    ADMIN,
    ADMIN_MODELS,
    ADMIN_SITE,
    API,
    API_KEY,
    INTEGRATION,
    OPENAI,
    OPERATOR,
    PUBLIC,
    REDIRECTS,
    SUPERUSER,
    TABLE,
    VIEWER,
    admin_table,
)
from tests.test_api_status_matrix import _objects

pytestmark = pytest.mark.django_db

RANK = {VIEWER: 1, OPERATOR: 2, ADMIN: 3, SUPERUSER: 4}
SIGNED_IN = (VIEWER, OPERATOR, ADMIN, SUPERUSER)
KEY_CALLERS = ("key-bearer", "key-token")
WRITE_METHODS = ("post", "put", "patch", "delete")
CALLERS = (None, *SIGNED_IN, *KEY_CALLERS)
CASES = b'{"id": "sum", "prompt": "2+2=", "expected": "4"}\n'


def full_table():
    return {**TABLE, **admin_table()}


def url_patterns() -> dict[str, str]:
    """{name (with namespaces): route} of every named URL pattern; unnamed ones only inside the admin."""
    found: dict[str, str] = {}

    def walk(resolver, prefix, namespace):
        for pattern in resolver.url_patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern, prefix + str(pattern.pattern),
                     namespace + (f"{pattern.namespace}:" if pattern.namespace else ""))
            elif pattern.name:
                found.setdefault(namespace + pattern.name, prefix + str(pattern.pattern))
            else:
                assert namespace == "admin:", f"{prefix}{pattern.pattern} has no name: name it and add it to the table"

    walk(get_resolver(), "", "")
    return found


def test_the_table_names_every_url_and_no_other():
    routes, table = url_patterns(), full_table()
    missing = sorted(set(routes) - set(table))
    stale = sorted((set(table) | set(REDIRECTS)) - set(routes))
    assert not missing, ("URLs with no row in tests/reliability/permissions_table.py: add each with the least role "
                         f"that reads it and that writes it: {missing}")
    assert not stale, f"rows of tests/reliability/permissions_table.py for URLs that no longer exist: {stale}"


def test_the_admin_rows_say_what_each_model_admin_allows(rf):
    request = rf.get("/admin/")
    request.user = User(username="root", is_staff=True, is_superuser=True, is_active=True)
    registered = {model._meta.label_lower: model_admin for model, model_admin in admin.site._registry.items()}
    assert sorted(registered) == sorted(ADMIN_MODELS), "add the model to ADMIN_MODELS in permissions_table.py"
    for label, model_admin in registered.items():
        allows = tuple(write for write in ("add", "change", "delete")
                       if getattr(model_admin, f"has_{write}_permission")(request))
        assert allows == ADMIN_MODELS[label], f"{label}: the admin allows {allows}"


# ---------------------------------------------------------------------------------------------------------------
# One object of each kind, and a client per caller


@pytest.fixture
def world(api, settings, tmp_path):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.INFEROPS_DATA_DIR = tmp_path
    ids = _objects(api)
    eval_set = set_services.evalset_create(name="smoke", scorer="exact", actor=None)
    set_services.version_upload(eval_set=eval_set, raw=CASES, actor=None)
    run = run_services.run_create(eval_set=eval_set, actor=None, target={"deployment": "chat"})
    # The console's routes name some objects by other words than the API's.
    ids.update({
        ("evalsets", "name"): "smoke", ("sets", "name"): "smoke", ("runs", "run_id"): run.pk, ("runs", "pk"): run.pk,
        ("versions", "number"): 1, ("rollouts", "pk"): ids["rollouts", "rollout_id"], ("slos", "name"): "chat-ttft",
        ("ack", "token"): ack_token(Alert.objects.get(pk=ids["alerts", "pk"])),
        ("users", "pk"): User.objects.get(username="viewer-api").pk,
        ("plotly-", "digest"): plotly_bundle().digest, ("export.", "kind"): "csv",
    })
    key, secret = tenant_services.key_create(tenant=Tenant.objects.get(name="acme"), name="gateway", actor=None)
    ids.update(batch_objects(settings, tmp_path, key))
    ids.update(capacity_objects())
    root = User.objects.create_superuser("root", password="pw-12345678")
    clients = {None: APIClient()}
    for role in (VIEWER, OPERATOR, ADMIN):
        user = User.objects.get(username=f"{role}-api")
        clients[role] = APIClient()
        clients[role].force_login(user)
        clients[role].credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get(user=user).key}")
    clients[SUPERUSER] = APIClient()
    clients[SUPERUSER].force_login(root)
    clients[SUPERUSER].credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=root)[0].key}")
    clients["key-bearer"] = APIClient()
    clients["key-bearer"].credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    clients["key-token"] = APIClient()
    clients["key-token"].credentials(HTTP_AUTHORIZATION=f"Token {secret}")
    for client in clients.values():
        client.raise_request_exception = False  # a server error is a 500 to report, not an exception
    return ids, clients


def batch_objects(settings, tmp_path, key) -> dict:
    """The key's tenant's input file and a batch in progress reading it (so deleting the file is refused)."""
    settings.STORAGES = {**settings.STORAGES, "batch_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": tmp_path / "batch-files"}}}
    content = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "chat"}}\n'
    file = BatchFile(tenant_id=key.tenant_id, key_prefix=key.prefix, purpose=FilePurpose.BATCH,
                     filename="input.jsonl", bytes=len(content), lines=1)
    file.storage_name = storage().save(f"files/{file.id}.jsonl", ContentFile(content))
    file.save()
    batch = Batch.objects.create(
        tenant_id=key.tenant_id, api_key=key, key_prefix=key.prefix, endpoint="/v1/chat/completions",
        completion_window="24h", model="chat", status=BatchStatus.IN_PROGRESS, input_file=file,
        input_file_ref=file.id, total=1, expires_at=timezone.now() + timedelta(days=1), in_progress_at=timezone.now())
    return {("files", "file_id"): file.id, ("batches", "batch_id"): batch.id}


def capacity_objects() -> dict:
    """A goodput curve of chat's version and a finished capacity run of chat."""
    chat = Deployment.objects.get(name="chat")
    curve = CapacityCurve.objects.create(version=chat.version, hardware="cpu:1", source="bench", input_len=8,
                                         output_len=8, points=[CAPACITY_POINT])
    run = CapacityRun.objects.create(deployment=chat, status="succeeded", rates=[1], step_s=5, input_len=8,
                                     output_len=8, curve=curve)
    return {("curves", "pk"): curve.pk, ("capacity-runs", "run_id"): run.pk}


def ready_replica_of_chat() -> None:
    """What a capacity run measures: one ready replica of chat's version at its engine arguments."""
    chat = Deployment.objects.get(name="chat")
    Replica.objects.create(deployment=chat, version=chat.version, node="test", url="http://127.0.0.1:9",
                           state="ready", engine_args=chat.engine_args)


def url_of(route: str, ids: dict) -> str:
    def value(match):
        before = route[:match.start()].rstrip("/").rsplit("/", 1)[-1]
        key = (before, match.group(2))
        assert key in ids, f"no object for {match.group(0)} after {before!r} in {route}"
        return str(ids[key])

    return "/" + re.sub(r"<(?:(\w+):)?(\w+)>", value, route)


# ---------------------------------------------------------------------------------------------------------------
# The matrix


def allowed(caller, needed) -> bool:
    if needed == PUBLIC:
        return True
    if needed == API_KEY:
        return caller == "key-bearer"
    if caller is None or caller in KEY_CALLERS or needed in (None, INTEGRATION):
        return False
    return RANK[caller] >= RANK[needed]


def verdict(response, kind: str, caller, needed, page: bool = False) -> str | None:
    """None when the answer is what the table says, else what is wrong with it; `page`: a console page's GET,
    which shows the page (200) to whoever may read it."""
    status = response.status_code
    if status >= 500:
        return f"a server error {status}"
    location = response.get("Location", "")
    to_login = status == 302 and ("/login/" in location)
    if needed is None:  # the URL takes no such request: refused, whoever asks
        return None if status in (401, 403, 405) or to_login else f"{status}, not 401, 403 or 405"
    if allowed(caller, needed):
        if needed == PUBLIC and caller in KEY_CALLERS and status == 401:
            return None  # an API's public page may refuse credentials it cannot read
        if status in (401, 403, 405) or to_login and needed != PUBLIC:  # signing out ends on the login page
            return f"{status} {location} where the table allows it"
        return None if not page or status == 200 else f"{status} {location}, not the page (200)"
    if kind == OPENAI:  # OpenAI's shape, whoever asks without the key: a signed-in user has none either
        ok = status == 401 and response.get("Content-Type") == "application/json" and "error" in response.json()
        return None if ok else f"{status} {location}, not a 401 OpenAI error"
    if caller is None or caller in KEY_CALLERS or needed == INTEGRATION and kind == API:
        wanted = "401" if kind == API else "a redirect to the login page"
        ok = status == 401 if kind == API else to_login
        return None if ok else f"{status} {location}, not {wanted}"
    if kind == ADMIN_SITE:  # the Django admin sends a signed-in non-superuser to its own login page
        return None if to_login or status == 403 else f"{status} {location}, not a redirect to the login page"
    return None if status == 403 else f"{status}, not 403"


def send(client, method: str, path: str, kind: str):
    """One request in a savepoint rolled back after it, the client's cookies as they were (a sign-out's too)."""
    cookies = client.cookies
    client.cookies = copy.copy(cookies)
    with transaction.atomic():
        if method == "get":
            response = client.get(path)
        elif kind in (API, OPENAI):
            response = getattr(client, method)(path, {}, format="json")
        else:
            response = client.post(path, {})
        transaction.set_rollback(True)
    client.cookies = cookies
    return response


ADMIN_PROBES = ("admin:index", "admin:registry_registeredmodel_changelist", "admin:registry_registeredmodel_add",
                "admin:auth_user_changelist", "admin:login")


def test_every_url_answers_every_caller_as_the_table_says(world):
    ids, clients = world
    routes = url_patterns()
    wrong = []
    for name, rule in full_table().items():
        if rule.kind == ADMIN_SITE and name not in ADMIN_PROBES:
            continue  # the admin's site-wide check is the same for every page: a few stand for all
        path = url_of(routes[name], ids)
        for caller in CALLERS:
            if rule.kind != ADMIN_SITE and caller == SUPERUSER:
                continue
            if rule.kind == ADMIN_SITE and caller in (VIEWER, OPERATOR):
                continue
            requests = [("get", rule.read)]
            if rule.write is not None:
                requests += [(method, rule.write) for method in rule.methods]
            if (rule.kind, caller) in ((API, ADMIN), (OPENAI, "key-bearer")) and rule.read != PUBLIC:
                # the methods the table leaves out
                requests += [(method, None) for method in WRITE_METHODS if method not in rule.methods]
            elif (caller is None or caller in KEY_CALLERS) and rule.read != PUBLIC:
                requests.append(("post", None))
            for method, needed in requests:
                response = send(clients[caller], method, path, rule.kind)
                page = method == "get" and rule.kind not in (API, OPENAI) and name not in REDIRECTS
                if problem := verdict(response, rule.kind, caller, needed, page):
                    wrong.append(f"{name} {method.upper()} {path} as {caller or 'anonymous'}: {problem}")
    assert not wrong, "\n".join(wrong)




# ---------------------------------------------------------------------------------------------------------------
# The audit check: one successful write per write the table lists, as the least role allowed to make it


class FormFields(HTMLParser):
    """The fields of a page's form, as a browser would submit it untouched (no button pressed)."""

    def __init__(self, action: str | None):
        super().__init__()
        self.action, self.inside, self.fields, self.select, self.textarea = action, action is None, {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form":
            self.inside = self.action is None and attrs.get("method", "").lower() == "post" and not attrs.get(
                "action") or attrs.get("action") == self.action
        elif not self.inside or "name" not in attrs and tag != "option":
            return
        elif tag == "input" and attrs.get("type") not in ("submit", "button", "file"):
            if attrs.get("type") not in ("checkbox", "radio") or "checked" in attrs:
                self.fields.setdefault(attrs["name"], []).append(attrs.get("value", "on" if attrs.get(
                    "type") in ("checkbox", "radio") else ""))
        elif tag == "select":
            self.select = attrs["name"]
            self.fields.setdefault(self.select, [])
        elif tag == "option" and self.select and "selected" in attrs:
            self.fields[self.select].append(attrs.get("value", ""))
        elif tag == "textarea":
            self.textarea = attrs["name"]
            self.fields[self.textarea] = [""]

    def handle_data(self, data):
        if self.textarea:
            self.fields[self.textarea][0] += data

    def handle_endtag(self, tag):
        if tag == "form":
            self.inside = False
        elif tag == "select":
            self.select = None
        elif tag == "textarea":
            self.textarea = None


def form_of(client, page: str, action: str | None = None, **changes) -> dict:
    """The form on `page` (the one posting to `action`, else the page's own), filled as shown, with `changes`."""
    response = client.get(page)
    assert response.status_code == 200, (page, response.status_code)
    parser = FormFields(action)
    parser.feed(response.content.decode())
    fields = {name: values if len(values) > 1 else values[0]
              for name, values in parser.fields.items() if values and name != "csrfmiddlewaretoken"}
    return {**fields, **changes}


def in_future(**delta) -> str:
    return (timezone.now() + timedelta(**delta)).isoformat().replace("+00:00", "Z")


def local(**delta) -> str:
    return (timezone.now() + timedelta(**delta)).strftime("%Y-%m-%dT%H:%M")


class Write:
    """One write about to be made: `send(body)` makes it as the least role allowed, to the entry's URL."""

    def __init__(self, client, path: str, method: str, kind: str, ids: dict, checkpoint):
        self.client, self.path, self.method, self.kind, self.ids, self.checkpoint = (
            client, path, method, kind, ids, checkpoint)

    def send(self, body=None, path: str | None = None, **kwargs):
        path = path or self.path
        if self.kind == API:
            return getattr(self.client, self.method)(path, body if body is not None else {}, format="json", **kwargs)
        return self.client.post(path, body or {}, **kwargs)

    def form(self, page: str | None = None, **changes):
        """The console's own form for this URL, as the page shows it, with `changes`."""
        return self.send(form_of(self.client, page or self.path, None if page is None else self.path, **changes))

    def rollout(self):
        return Rollout.objects.get(pk=self.ids["rollouts", "rollout_id"])

    def aborted(self):
        rollouts.rollout_abort(rollout=self.rollout(), actor=None)
        return self

    def paused(self):
        """At its first pause or analysis step: what promote ends."""
        rollout = self.rollout()
        step = next(index for index, step in enumerate(rollout.steps) if "set_weight" not in step)
        Rollout.objects.filter(pk=rollout.pk).update(status=RolloutStatus.PAUSED, step_index=step)
        return self

    def unused(self):
        unused()
        return self

    def future_price(self):
        price = costing_services.price_create(resource="memory", usd_per_hour=Decimal("0.01"),
                                              effective_from=datetime(2099, 1, 1, tzinfo=UTC), actor=None)
        return self.send(path=self.path.replace(f"/{self.ids['prices', 'pk']}/", f"/{price.pk}/"))


def unused():
    """The routes and the escalation policy gone: a receiver or schedule they use is not deleted."""
    for policy in EscalationPolicy.objects.all():
        routing_services.policy_delete(policy=policy, actor=None)
    for route in Route.objects.filter(parent__isnull=False).order_by("-pk"):  # all but the default route
        routing_services.route_delete(route=route, actor=None)


def openslo_copy(w: Write):
    text = w.client.get(f"/api/v1/slos/{w.ids['slos', 'pk']}/openslo/").content.decode()
    return w.client.post(w.path, data=text.replace("chat-ttft", "chat-e2e").encode(), content_type="application/yaml")


def deployment_edit(w: Write):
    review = form_of(w.client, w.path, replicas="2")
    token = re.search(r'name="confirm" value="([^"]+)"', w.send(review).content.decode()).group(1)
    return w.send({**review, "confirm": token})


def alertmanager_alert(w: Write):
    _, token = integration_create(name="am-audit", actor=None)
    w.client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return w.send({"receiver": "inferops", "status": "firing", "version": "4", "groupLabels": {}, "commonLabels": {},
                   "commonAnnotations": {}, "externalURL": "http://alertmanager:9093", "alerts": [{
                       "status": "firing", "labels": {"alertname": "NodeDown", "instance": "node-1"},
                       "annotations": {}, "startsAt": in_future(), "endsAt": "0001-01-01T00:00:00Z",
                       "generatorURL": "", "fingerprint": "f00d"}]})


LAYER = {"name": "weekly", "rotation": "weekly", "starts_at": "2025-03-03T09:00:00Z", "users": ["viewer-api"]}
SILENCE = {"matchers": [{"name": "alertname", "value": "DiskFull", "isRegex": False}], "startsAt": in_future(),
           "endsAt": in_future(hours=2), "createdBy": "ana", "comment": "maintenance"}
LEVELS = [{"name": "shed-batch", "enter_burn_rate": 5, "exit_burn_rate": 2, "actions": {"shed_below_priority": 5}}]
DEGRADATION = {"enabled": True, "window": "5m", "hold_s": 60, "slos": [], "levels": LEVELS}
SLO = {"name": "chat-e2e", "deployment": "chat", "sli": {"kind": "latency", "ttft_ms": 800}, "objective": 0.99,
       "window": "1d", "budgeting": "occurrences"}
NDJSON = "application/x-ndjson"
CAPACITY_POINT = {"rps": 1, "throughput_rps": 1, "ttft_p95_ms": 20, "completed": 5, "failed": 0}

# (url name, method) -> how to make one valid write through it (Write -> response).
WRITES = {
    # The REST API.
    ("api-model-list", "post"): lambda w: w.send({"name": "other", "task": "generate"}),
    ("api-model-detail", "patch"): lambda w: w.send({"description": "a tiny model"}),
    ("api-version-list", "post"): lambda w: w.send({"artifact_uri": str(w.checkpoint)}),
    ("api-alias-detail", "put"): lambda w: w.send({"version": 2}),
    ("api-alias-detail", "delete"): lambda w: w.send(),
    ("api-deployment-list", "post"): lambda w: w.send({"name": "chat-2", "model": "tiny", "version": 1,
                                                       "replicas": 1}),
    ("api-deployment-detail", "patch"): lambda w: w.send({"replicas": 2}),
    ("api-deployment-detail", "delete"): lambda w: w.send(),
    ("api-rollout-list", "post"): lambda w: w.aborted().send({"version": 2}),
    ("api-rollout-undo", "post"): lambda w: w.send(),
    ("api-rollout-detail", "patch"): lambda w: w.send({"auto_rollback": not w.rollout().auto_rollback}),
    ("api-rollout-promote", "post"): lambda w: w.paused().send(),
    ("api-rollout-abort", "post"): lambda w: w.send(),
    ("api-rollout-retry", "post"): lambda w: w.aborted().send(),
    ("api-degradation", "put"): lambda w: w.send({**DEGRADATION, "hold_s": 120}),
    ("api-degradation-override", "post"): lambda w: w.send({"level": 1, "until": "1h", "reason": "drill"}),
    ("api-degradation-override", "delete"): lambda w: w.send(),
    ("api-evalset-list", "post"): lambda w: w.send({"name": "other", "scorer": "exact"}),
    ("api-evalset-detail", "patch"): lambda w: w.send({"description": "arithmetic"}),
    ("api-evalset-version-list", "post"): lambda w: w.client.generic("POST", w.path, CASES, content_type=NDJSON),
    ("api-eval-run-list", "post"): lambda w: w.send({"eval_set": "smoke", "target": {"deployment": "chat"}}),
    ("api-eval-run-cancel", "post"): lambda w: w.send(),
    ("api-slo-list", "post"): lambda w: w.send(SLO),
    ("api-slo-detail", "patch"): lambda w: w.send({"objective": 0.99}),
    ("api-slo-detail", "delete"): lambda w: w.send(),
    ("api-slo-import", "post"): openslo_copy,
    ("api-alertmanager-receiver", "post"): alertmanager_alert,
    ("api-alert-ack", "post"): lambda w: w.send(),
    ("api-alert-resolve", "post"): lambda w: w.send(),
    ("api-alert-snooze", "post"): lambda w: w.send({"minutes": 30}),
    ("api-alert-comments", "post"): lambda w: w.send({"text": "looking"}),
    ("api-receiver-list", "post"): lambda w: w.send({"name": "hook-2", "url": "https://hooks.example/b"}),
    ("api-receiver-detail", "patch"): lambda w: w.send({"url": "https://hooks.example/c"}),
    ("api-receiver-detail", "delete"): lambda w: w.unused().send(),
    ("api-integration-list", "post"): lambda w: w.send({"name": "am-2"}),
    ("api-integration-detail", "delete"): lambda w: w.send(),
    ("api-silence-list", "post"): lambda w: w.send(SILENCE),
    ("api-silence-detail", "delete"): lambda w: w.send(),
    ("api-route-list", "post"): lambda w: w.send({"matchers": [{"name": "severity", "value": "ticket", "op": "="}],
                                                  "receiver": "hook"}),
    ("api-route-detail", "patch"): lambda w: w.send({"group_wait_s": 10}),
    ("api-route-detail", "put"): lambda w: w.send({"matchers": [{"name": "severity", "value": "page", "op": "="}],
                                                   "receiver": "hook", "group_wait_s": 20}),
    ("api-route-detail", "delete"): lambda w: w.send(),
    ("api-policy-list", "post"): lambda w: w.send({"name": "p-2", "steps": [{"after_minutes": 0,
                                                                             "receivers": ["hook"]}]}),
    ("api-policy-detail", "put"): lambda w: w.send({"name": "chat-oncall", "steps": [{"after_minutes": 5,
                                                                                      "receivers": ["hook"]}]}),
    ("api-policy-detail", "delete"): lambda w: w.send(),
    ("api-schedule-list", "post"): lambda w: w.send({"name": "secondary", "time_zone": "UTC", "layers": [LAYER]}),
    ("api-schedule-detail", "put"): lambda w: w.send({"name": "primary", "time_zone": "Europe/Paris",
                                                      "layers": [LAYER]}),
    ("api-schedule-detail", "delete"): lambda w: w.unused().send(),
    ("api-schedule-overrides", "post"): lambda w: w.send({"user": "viewer-api", "starts_at": "2025-03-05T00:00:00Z",
                                                          "ends_at": "2025-03-05T06:00:00Z"}),
    ("api-schedule-override-detail", "delete"): lambda w: w.send(),
    ("api-tenant-list", "post"): lambda w: w.send({"name": "beta"}),
    ("api-tenant-detail", "patch"): lambda w: w.send({"rpm_limit": 60}),
    ("api-key-list", "post"): lambda w: w.send({"name": "ci-2"}),
    ("api-key-detail", "delete"): lambda w: w.send(),
    ("api-costing-prices", "post"): lambda w: w.send({"resource": "memory", "usd_per_hour": "0.01",
                                                      "effective_from": "2099-01-01T00:00:00Z"}),
    ("api-costing-price", "delete"): lambda w: w.future_price(),
    ("api-costing-list-prices", "post"): lambda w: w.send({
        "deployment": "chat", "usd_per_mtok_prompt": "2.00", "usd_per_mtok_completion": "5.00",
        "effective_from": "2099-01-01T00:00:00Z"}),
    ("api-costing-budgets", "post"): lambda w: w.send({"tenant": "acme", "deployment": "chat", "monthly_usd": "9.00"}),
    ("api-costing-budget", "patch"): lambda w: w.send({"monthly_usd": "8.00"}),
    ("api-costing-budget", "delete"): lambda w: w.send(),
    ("api-capacity-curves", "post"): lambda w: w.send({"deployment": "chat", "input_len": 8, "output_len": 8,
                                                       "points": [CAPACITY_POINT]}),
    ("api-capacity-runs", "post"): lambda w: (ready_replica_of_chat(), w.send({"rates": [1, 2], "step_s": 5}))[1],
    ("api-autoscaling", "put"): lambda w: w.send({"enabled": True, "min_replicas": 0, "max_replicas": 2}),
    # The console.
    ("users", "post"): lambda w: w.send({"username": "dana", "email": "", "role": "operator", "password": ""}),
    ("user-role", "post"): lambda w: w.send({"role": "operator"}),
    ("user-deactivate", "post"): lambda w: w.send(),
    ("registry:version-new", "post"): lambda w: w.send({"artifact_uri": str(w.checkpoint)}),
    ("registry:alias-move", "post"): lambda w: w.send({"alias": "challenger", "version": "2"}),
    ("deployments:create", "post"): lambda w: w.send({
        "name": "chat-2", "version": "tiny:1", "backend": "builtin", "driver": "local", "replicas": "1"}),
    ("deployments:edit", "post"): deployment_edit,
    ("deployments:rollout-start", "post"): lambda w: w.aborted().form("/deployments/chat/", **{
        "rollout-version": "2"}),
    ("deployments:rollout-undo", "post"): lambda w: w.send(),
    ("deployments:rollout-promote", "post"): lambda w: w.paused().send(),
    ("deployments:rollout-promote-full", "post"): lambda w: w.send(),
    ("deployments:rollout-abort", "post"): lambda w: w.send(),
    ("deployments:rollout-retry", "post"): lambda w: w.aborted().send(),
    ("deployments:rollout-auto-rollback-on", "post"): lambda w: (rollouts.rollout_set_auto_rollback(
        rollout=w.rollout(), actor=None, auto_rollback=False), w.send())[1],
    ("deployments:rollout-auto-rollback-off", "post"): lambda w: (rollouts.rollout_set_auto_rollback(
        rollout=w.rollout(), actor=None, auto_rollback=True), w.send())[1],
    ("degradation:policy", "post"): lambda w: w.send({
        "policy-enabled": "on", "policy-window": "5m", "policy-hold_s": "90", "policy-levels": json.dumps(LEVELS)}),
    ("degradation:override", "post"): lambda w: w.send({"override-level": "1", "override-until": "1h",
                                                        "override-reason": "drill"}),
    ("degradation:override-clear", "post"): lambda w: w.send({"reason": "over"}),
    ("tenants:list", "post"): lambda w: w.send({"name": "beta"}),
    ("tenants:detail", "post"): lambda w: w.send({"name": "ci-2", "priority": "0"}),
    ("tenants:limits", "post"): lambda w: w.send({"limits-display_name": "", "limits-rpm_limit": "5"}),
    ("tenants:key-revoke", "post"): lambda w: w.send(),
    ("slo:create", "post"): lambda w: w.send(form_of(
        w.client, w.path, name="chat-e2e", scope="deployment", deployment="chat", sli_kind="latency", ttft_ms="800",
        objective="0.99", window="1d", budgeting="occurrences")),
    ("slo:edit", "post"): lambda w: w.form(objective="0.99"),
    ("evals:set-new", "post"): lambda w: w.send({"name": "other", "scorer": "exact"}),
    ("evals:version-new", "post"): lambda w: w.send({"file": SimpleUploadedFile("cases.jsonl", CASES)}),
    ("evals:run-cancel", "post"): lambda w: w.send(),
    ("alerts:ack-link", "post"): lambda w: w.send(),
    ("alerts:integrations", "post"): lambda w: w.send({"name": "am-2"}),
    ("alerts:integration-deactivate", "post"): lambda w: w.send(),
    ("alerts:silence-new", "post"): lambda w: w.send({"matchers": "alertname=DiskFull", "starts": local(),
                                                      "ends": local(hours=2), "comment": "maintenance"}),
    ("alerts:silence-edit", "post"): lambda w: w.form(comment="kernel upgrade, again"),
    ("alerts:silence-expire", "post"): lambda w: w.send(),
    ("alerts:acknowledge", "post"): lambda w: w.send(),
    ("alerts:resolve", "post"): lambda w: w.send(),
    ("alerts:snooze", "post"): lambda w: w.send({"minutes": "60"}),
    ("alerts:comment", "post"): lambda w: w.send({"text": "looking"}),
    ("alerts:schedule-new", "post"): lambda w: w.send(form_of(
        w.client, w.path, **{"name": "secondary", "time_zone": "UTC", "layers-0-name": "weekly",
                             "layers-0-rotation": "weekly", "layers-0-starts": "2025-03-03T09:00",
                             "layers-0-users": "viewer-api"})),
    ("alerts:schedule-edit", "post"): lambda w: w.form(description="the primary rota"),
    ("alerts:schedule-delete", "post"): lambda w: w.unused().send(),
    ("alerts:schedule-override-add", "post"): lambda w: w.send({"user": "viewer-api", "starts": "2025-03-05T00:00",
                                                                "ends": "2025-03-05T06:00", "reason": "swap"}),
    ("alerts:schedule-override-delete", "post"): lambda w: w.send(),
    ("alerts:route-new", "post"): lambda w: w.send(form_of(w.client, w.path, matchers="severity=ticket",
                                                           receiver="hook")),
    ("alerts:route-edit", "post"): lambda w: w.form(group_wait_s="10"),
    ("alerts:route-delete", "post"): lambda w: w.send(),
    ("alerts:policy-new", "post"): lambda w: w.send(form_of(w.client, w.path, **{
        "name": "p-2", "step-0-after_minutes": "0", "step-0-receivers": "hook"})),
    ("alerts:policy-edit", "post"): lambda w: w.form(description="chat's on-call"),
    ("alerts:policy-delete", "post"): lambda w: w.send(),
    ("alerts:receiver-new", "post"): lambda w: w.send(form_of(w.client, w.path, name="hook-2", kind="webhook",
                                                              url="https://hooks.example/b")),
    ("alerts:receiver-edit", "post"): lambda w: w.form(url="https://hooks.example/c"),
    ("alerts:receiver-delete", "post"): lambda w: w.unused().send(),
    ("costing:prices", "post"): lambda w: w.send({"resource": "memory", "usd_per_hour": "0.01", "tier": "on-demand",
                                                  "effective_from": "2099-01-01T00:00", "note": ""}),
    ("costing:price-delete", "post"): lambda w: w.future_price(),
    ("costing:budgets", "post"): lambda w: w.send({"tenant": "acme", "deployment": "chat", "monthly_usd": "9",
                                                   "thresholds": "50, 100"}),
    ("batch-detail", "post"): lambda w: w.send(),
    ("capacity-run-start", "post"): lambda w: (ready_replica_of_chat(), w.send({"rates": "1, 2", "step_s": "5"}))[1],
    ("autoscaling-edit", "post"): lambda w: w.send({"autoscaling-enabled": "on", "autoscaling-min_replicas": "1",
                                                    "autoscaling-max_replicas": "2",
                                                    "autoscaling-signal_kv_usage": "0.8"}),
}
ACTOR = {VIEWER: "viewer-api", OPERATOR: "operator-api", ADMIN: "admin-api", SUPERUSER: "root"}


def outcome(response) -> str | None:
    """None for a write that went through, else what the answer says."""
    location = response.get("Location", "")
    if response.status_code >= 400 or "/login/" in location:
        text = response.content.decode(errors="replace")
        errors = re.findall(r'class="(?:errorlist|error|messages?)[^"]*"[^>]*>(.*?)</', text, re.S)
        return f"{response.status_code} {location} {errors or text[:300]}"
    return None


def test_every_write_leaves_an_audit_event_naming_who_wrote(world, tiny_llama_dir):
    ids, clients = world
    routes = url_patterns()
    table = {name: rule for name, rule in TABLE.items() if rule.write is not None and not rule.quiet}
    missing = sorted(f"{name} {method}" for name, rule in table.items() for method in rule.methods
                     if (name, method) not in WRITES)
    assert not missing, f"writes with no valid request in WRITES (add one, or the table's reason it records none): "\
                        f"{missing}"
    wrong = []
    for name, rule in table.items():
        for method in rule.methods:
            client = clients[rule.write] if rule.write in ACTOR else APIClient()
            client.raise_request_exception = False
            cookies = copy.copy(client.cookies)
            write = Write(client, url_of(routes[name], ids), method, rule.kind, ids, tiny_llama_dir)
            with transaction.atomic():
                last = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
                response = WRITES[name, method](write)
                events = list(AuditEvent.objects.filter(pk__gt=last).values_list("action", "actor_name"))
                transaction.set_rollback(True)
            client.cookies = cookies
            actor = ACTOR.get(rule.write)
            if problem := outcome(response):
                wrong.append(f"{name} {method.upper()}: refused, {problem}")
            elif not events:
                wrong.append(f"{name} {method.upper()}: no audit event")
            elif actor and not any(who == actor for _, who in events):
                wrong.append(f"{name} {method.upper()}: the audit events {events} do not name {actor}")
    assert not wrong, "\n".join(wrong)


class AdminWrite:
    """A superuser's add, change or delete of one row in the Django admin, through its own form."""

    def __init__(self, client, label: str):
        self.client, self.base = client, "/admin/{}/{}/".format(*label.split("."))

    def add(self, **fields):
        page = f"{self.base}add/"
        return self.client.post(page, form_of(self.client, page, **fields))

    def change(self, pk, **changes):
        page = f"{self.base}{pk}/change/"
        return self.client.post(page, form_of(self.client, page, **changes))

    def delete(self, pk):
        return self.client.post(f"{self.base}{pk}/delete/", {"post": "yes"})


def fresh_user() -> User:
    return User.objects.create_user("eve", password="pw-12345678")


def row(model, **lookup) -> int:
    return apps.get_model(model).objects.get(**lookup).pk


PASSWORDS = {"password1": "a-long-pass-phrase-1", "password2": "a-long-pass-phrase-1", "usable_password": "true"}
# (model, admin write) -> how to make it (AdminWrite -> response), for each write ADMIN_MODELS lists.
ADMIN_WRITES = {
    ("registry.registeredmodel", "add"): lambda a: a.add(name="other", task="generate"),
    ("registry.registeredmodel", "change"): lambda a: a.change(row("registry.registeredmodel", name="tiny"),
                                                               description="a tiny model"),
    ("registry.alias", "add"): lambda a: a.add(model=str(row("registry.registeredmodel", name="tiny")),
                                               name="challenger",
                                               version=str(row("registry.modelversion", number=2))),
    ("registry.alias", "change"): lambda a: a.change(row("registry.alias", name="champion"),
                                                     version=str(row("registry.modelversion", number=2))),
    ("registry.alias", "delete"): lambda a: a.delete(row("registry.alias", name="champion")),
    ("deployments.deployment", "change"): lambda a: a.change(row("deployments.deployment", name="chat"), replicas="2"),
    ("deployments.deployment", "delete"): lambda a: a.delete(row("deployments.deployment", name="chat")),
    ("tenants.tenant", "add"): lambda a: a.add(name="beta"),
    ("tenants.tenant", "change"): lambda a: a.change(row("tenants.tenant", name="acme"), rpm_limit="60"),
    ("slo.slo", "add"): lambda a: a.add(name="chat-e2e", deployment=str(row("deployments.deployment", name="chat")),
                                        sli_kind="latency", ttft_ms="800", objective="0.99", window="1d",
                                        budgeting="occurrences"),
    ("slo.slo", "change"): lambda a: a.change(row("slo.slo", name="chat-ttft"), objective="0.99"),
    ("slo.slo", "delete"): lambda a: a.delete(row("slo.slo", name="chat-ttft")),
    ("evals.evalset", "add"): lambda a: a.add(name="other", scorer="exact"),
    ("evals.evalset", "change"): lambda a: a.change(row("evals.evalset", name="smoke"), description="arithmetic"),
    ("alerts.receiver", "add"): lambda a: a.add(name="hook-2", kind="webhook", url="https://hooks.example/b"),
    ("alerts.receiver", "change"): lambda a: a.change(row("alerts.receiver", name="hook"),
                                                      url="https://hooks.example/c"),
    ("alerts.receiver", "delete"): lambda a: (unused(), a.delete(row("alerts.receiver", name="hook")))[1],
    ("auth.user", "add"): lambda a: a.add(username="eve", **PASSWORDS),
    ("auth.user", "change"): lambda a: a.change(fresh_user().pk, first_name="Eve"),
    ("auth.user", "delete"): lambda a: a.delete(fresh_user().pk),
    ("auth.group", "add"): lambda a: a.add(name="auditors"),
    ("auth.group", "change"): lambda a: a.change(Group.objects.create(name="auditors").pk, name="reviewers"),
    ("auth.group", "delete"): lambda a: a.delete(Group.objects.create(name="auditors").pk),
    ("authtoken.tokenproxy", "add"): lambda a: a.add(user=str(fresh_user().pk)),
    ("authtoken.tokenproxy", "change"): lambda a: a.change(Token.objects.create(user=fresh_user()).user_id),
    ("authtoken.tokenproxy", "delete"): lambda a: a.delete(Token.objects.create(user=fresh_user()).user_id),
}


def test_every_write_in_the_django_admin_leaves_an_audit_event(world):
    _, clients = world
    writes = [(label, write) for label, allows in ADMIN_MODELS.items() for write in allows]
    missing = sorted(f"{label} {write}" for label, write in writes if (label, write) not in ADMIN_WRITES)
    assert not missing, f"admin writes with no valid request in ADMIN_WRITES: {missing}"
    client = clients[SUPERUSER]
    wrong = []
    for label, write in writes:
        cookies = copy.copy(client.cookies)
        with transaction.atomic():
            last = AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
            response = ADMIN_WRITES[label, write](AdminWrite(client, label))
            events = list(AuditEvent.objects.filter(pk__gt=last).values_list("action", "actor_name"))
            transaction.set_rollback(True)
        client.cookies = cookies
        if problem := outcome(response):
            wrong.append(f"{label} {write}: refused, {problem}")
        elif not events:
            messages = [str(m) for m in get_messages(response.wsgi_request)]
            wrong.append(f"{label} {write}: no audit event ({response.status_code} {messages})")
        elif not any(who == "root" for _, who in events):
            wrong.append(f"{label} {write}: the audit events {events} do not name root")
    assert not wrong, "\n".join(wrong)


def test_a_signed_in_account_with_no_role_reads_no_console_page(world):
    """Found by this table: console views checked only that someone was signed in, so an account with no
    role (one added in the Django admin without a group) read what the API refused it."""
    ids, _ = world
    client = APIClient()
    client.force_login(User.objects.create_user("nobody", password="pw-12345678"))
    routes = url_patterns()
    readable = [name for name, rule in TABLE.items()
                if rule.kind not in (API, OPENAI) and rule.read not in (None, PUBLIC)
                and client.get(url_of(routes[name], ids)).status_code not in (302, 403)]
    assert not readable, f"an account with no role reads {readable}"
