"""Every URL of the control plane answers each caller as tests/reliability/permissions_table.py says, and every
write it lists leaves an audit event naming who wrote (issue 40).

The callers: anonymous, viewer, operator, admin (a token for the API, a session for the console), a superuser
for the Django admin, and a tenant's API key sent as `Authorization: Bearer <secret>` and as `Token <secret>`,
which the control plane must treat as no credential at all. Requests run in-process, each in a savepoint rolled
back after it, so every one sees the same objects (one of each kind, as tests/test_api_status_matrix.py seeds).
"""

from __future__ import annotations

import copy
import re

import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.urls import URLResolver, get_resolver
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from alerts.services import ack_token
from evals.runs import services as run_services
from evals.sets import services as set_services
from inferops.assets import plotly_bundle
from tenants import services as tenant_services
from tenants.models import Tenant
from tests.reliability.permissions_table import (
    ADMIN,
    ADMIN_MODELS,
    ADMIN_SITE,
    API,
    INTEGRATION,
    OPERATOR,
    PUBLIC,
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
    stale = sorted(set(table) - set(routes))
    assert not missing, ("URLs with no row in tests/reliability/permissions_table.py: add each with the least role "
                         f"that reads it and that writes it: {missing}")
    assert not stale, f"rows of tests/reliability/permissions_table.py for URLs that no longer exist: {stale}"


def test_the_admin_rows_say_what_each_model_admin_allows(rf):
    from django.contrib import admin

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
    alert_id = ids["alerts", "pk"]
    from alerts.models import Alert

    ids.update({
        ("evalsets", "name"): "smoke", ("sets", "name"): "smoke", ("runs", "run_id"): run.pk, ("runs", "pk"): run.pk,
        ("models", "number"): 1, ("versions", "number"): 1, ("rollouts", "pk"): ids["rollouts", "rollout_id"],
        ("deployments", "name"): "chat", ("slos", "name"): "chat-ttft", ("ack", "token"): ack_token(
            Alert.objects.get(pk=alert_id)),
        ("users", "pk"): User.objects.get(username="viewer-api").pk,
        ("keys", "prefix"): ids["keys", "prefix"], ("silences", "pk"): ids["silences", "pk"],
        ("plotly-", "digest"): plotly_bundle().digest, ("export.", "kind"): "csv",
        ("escalation-policies", "name"): "chat-oncall", ("prices", "pk"): ids["prices", "pk"],
    })
    key, secret = tenant_services.key_create(tenant=Tenant.objects.get(name="acme"), name="gateway", actor=None)
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
    if caller is None or caller in KEY_CALLERS or needed in (None, INTEGRATION):
        return False
    return RANK[caller] >= RANK[needed]


def verdict(response, kind: str, caller, needed) -> str | None:
    """None when the answer is what the table says, else what is wrong with it."""
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
        return None
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
        elif kind == API:
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
            elif (caller is None or caller in KEY_CALLERS) and rule.read != PUBLIC:
                requests.append(("post", None))
            for method, needed in requests:
                response = send(clients[caller], method, path, rule.kind)
                if problem := verdict(response, rule.kind, caller, needed):
                    wrong.append(f"{name} {method.upper()} {path} as {caller or 'anonymous'}: {problem}")
    assert not wrong, "\n".join(wrong)


