"""Every REST API URL answers each method and role as it did before the ViewSet move (issue 37).

tests/test_openapi_unchanged.py sees only what the schema declares. This test sees the rest: one object
of every kind the API exposes, then for every URL under /api/v1/ (from the URLconf; once with the objects'
ids, once more with its last id one that does not exist, "(missing)") GET, HEAD, OPTIONS, POST, PUT, PATCH
and DELETE with an empty JSON body as anonymous, viewer, operator and admin, each request in a savepoint
rolled back after it, so every request sees the same rows. It records the status code, the body of an
error answer (a 403's role, a 400's fields, a 404's message), the keys of a success answer, and OPTIONS'
Allow header and body, and compares them with tests/fixtures/api-status-matrix.json. That snapshot was
written by this very file in a git worktree of 9f32e02, before any APIView became a ViewSet:

    git worktree add /tmp/old 9f32e02 && cp tests/test_api_status_matrix.py /tmp/old/tests/ && cd /tmp/old
    PYTHONPATH=/tmp/old INFEROPS_WRITE_MATRIX=<this repo>/tests/fixtures/api-status-matrix.json \
        <this repo>/.venv/bin/python -m pytest tests/test_api_status_matrix.py

Do not rewrite the snapshot to make this pass: a deliberate change goes into CHANGED with its reason.
URLs added since the snapshot (the eval sets and runs, the version comparison) are left out here: the
snapshot has no "before" for them, and their own tests cover their methods and roles.
"""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.apps import apps
from django.db import connection, transaction
from django.urls import URLResolver, get_resolver
from django.utils import timezone

from alerts.models import Alert
from registry.models import Alias, RegisteredModel
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db

SNAPSHOT = Path(__file__).parent / "fixtures" / "api-status-matrix.json"
METHODS = ("get", "head", "options", "post", "put", "patch", "delete")
ROLES = (None, "viewer", "operator", "admin")
WORDING = ("name", "description")
# "url-name METHOD role" -> (before, after, why): an answer that changed on purpose.
_OLD_SERIES = ("requests_per_s, output_tokens_per_s, ttft_p50, ttft_p95, ttft_p99, itl_p95, kv_cache_usage, "
               "queue_depth")
_SLO_SERIES = ("slo_judged_per_s, slo_missed_ttft_per_s, slo_missed_tpot_per_s, slo_rejected_late_per_s, "
               "slo_served_late_per_s")
_GPU_SERIES = "gpu_utilization, gpu_memory_used, gpu_memory_total, mfu"
CHANGED: dict[str, tuple[object, object, str]] = {
    f"api-deployment-metrics GET {role}": (
        {"body": {"series": [f"One of: {_OLD_SERIES}, error_rate."]}, "status": 400},
        {"body": {"series": [f"One of: {_OLD_SERIES}, {_GPU_SERIES}, {_SLO_SERIES}, error_rate."]}, "status": 400},
        "issue 39: the engine's SLO scheduling series, named among the choices; issue 43: the GPU series and mfu")
    for role in ("viewer", "operator", "admin")
}
# Fields added to existing answers on purpose (field -> why); a client that ignores unknown fields sees no change.
ADDED_FIELDS = {
    "quality": "issue 38: a rollout's quality steps and their eval runs; an SLO's floor and latest eval run",
    "fallbacks": "issue 38: each degradation fallback's eval scores beside the deployment's own",
    "warnings": "issue 38: a fallback that scores lower than the deployment, said without refusing",
    "batch_discount_percent": "issue 41: a list price's discount for lines of offline batches",
    "batch_tokens": "issue 41: the cost report's offline batch tokens",
    "batch_usd": "issue 41: the cost report's offline batch tokens' share of the cost",
    "batch_revenue_usd": "issue 41: the cost report's revenue of offline batches at the batch price",
    "cold_start": "issue 42: a replica's latest start and the seconds of its cold start's phases",
    **{name: "issue 43: the cost report's GPU-hours, measured and busy ones, their busy share and those not measured"
       for name in ("gpu_hours", "gpu_hours_measured", "gpu_hours_busy", "gpu_busy_share", "gpu_hours_not_measured")},
}


def _without_added(answer: dict) -> dict:
    """The answer less ADDED_FIELDS and the fields' help texts (wording, as in the schema test)."""
    answer = json.loads(json.dumps(answer))
    if "keys" in answer:
        answer["keys"] = [key for key in answer["keys"] if key not in ADDED_FIELDS]
    for fields in answer.get("options", {}).get("actions", {}).values():
        for name in [name for name in fields if name in ADDED_FIELDS]:
            del fields[name]
        for field in fields.values():
            field.pop("help_text", None)
    return answer


def _iso(delta: timedelta = timedelta()) -> str:
    return (timezone.now() + delta).isoformat().replace("+00:00", "Z")


def _created(response) -> dict:
    assert response.status_code in (200, 201), (response.status_code, response.content)
    return response.json()


def _same_ids_every_run() -> None:
    """Ids start at 1001 in every table, so an answer naming one ("Rollout 1001 is ...") reads alike in both runs."""
    with connection.cursor() as cursor:
        for model in apps.get_models():
            cursor.execute("SELECT setval(pg_get_serial_sequence(%s, %s), 1000)",
                           [model._meta.db_table, model._meta.pk.column])


def _objects(api) -> dict[tuple[str, str], object]:
    """One object of each kind, through the API where it has a create; {(collection, url kwarg): value}."""
    _same_ids_every_run()
    admin = api("admin")
    for role in ROLES[1:]:
        api(role)  # the users the schedule and its override name
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1 = make_version(model, 1)
    make_version(model, 2)  # the rollout's candidate
    Alias.objects.create(model=model, name="champion", version=v1)
    _created(admin.post("/api/v1/deployments/", {"name": "chat", "model": "tiny", "version": 1, "replicas": 1},
                        format="json"))
    rollout = _created(admin.post("/api/v1/deployments/chat/rollouts/", {"version": 2}, format="json"))
    slo = _created(admin.post("/api/v1/slos/", {
        "name": "chat-ttft", "deployment": "chat", "sli": {"kind": "latency", "ttft_ms": 500}, "objective": 0.995,
        "window": "1d", "budgeting": "occurrences"}, format="json"))
    alert = Alert.objects.create(fingerprint="matrix0000000001", labels={"alertname": "SloBurn", "slo": "chat-ttft"},
                                 severity="page", starts_at=timezone.now(), slo_id=slo["id"])
    _created(admin.post("/api/v1/tenants/", {"name": "acme"}, format="json"))
    key = _created(admin.post("/api/v1/tenants/acme/keys/", {"name": "ci", "deployments": ["chat"]}, format="json"))
    receiver = _created(admin.post("/api/v1/receivers/", {"name": "hook", "url": "https://hooks.example/am"},
                                   format="json"))
    route = _created(admin.post("/api/v1/routes/", {
        "matchers": [{"name": "severity", "value": "page", "op": "="}], "receiver": "hook"}, format="json"))
    _created(admin.post("/api/v1/schedules/", {
        "name": "primary", "time_zone": "UTC", "layers": [
            {"name": "weekly", "rotation": "weekly", "starts_at": "2025-03-03T09:00:00Z", "users": ["viewer-api"]}]},
        format="json"))
    override = _created(admin.post("/api/v1/schedules/primary/overrides/", {
        "user": "operator-api", "starts_at": "2025-03-04T00:00:00Z", "ends_at": "2025-03-04T06:00:00Z",
        "reason": "swap"}, format="json"))
    _created(admin.post("/api/v1/escalation-policies/", {
        "name": "chat-oncall", "steps": [{"after_minutes": 0, "receivers": ["hook"]},
                                         {"after_minutes": 15, "schedule": "primary"}]}, format="json"))
    silence = _created(admin.post("/api/v1/silences/", {
        "matchers": [{"name": "alertname", "value": "NodeDown", "isRegex": False}], "startsAt": _iso(),
        "endsAt": _iso(timedelta(hours=2)), "createdBy": "ana", "comment": "kernel upgrade"}, format="json"))
    integration = _created(admin.post("/api/v1/integrations/", {"name": "prod-am"}, format="json"))
    price = _created(admin.post("/api/v1/costing/prices/", {
        "resource": "cpu", "usd_per_hour": "0.05", "effective_from": "2026-01-01T00:00:00Z"}, format="json"))
    _created(admin.post("/api/v1/costing/list-prices/", {
        "deployment": "chat", "usd_per_mtok_prompt": "1.00", "usd_per_mtok_completion": "4.00",
        "effective_from": "2026-01-01T00:00:00Z"}, format="json"))
    budget = _created(admin.post("/api/v1/costing/budgets/", {"tenant": "acme", "monthly_usd": "4.00",
                                                              "thresholds": [50, 100]}, format="json"))
    _created(admin.put("/api/v1/deployments/chat/degradation/", {
        "enabled": True, "window": "5m", "hold_s": 60, "slos": [], "levels": [
            {"name": "shed-batch", "enter_burn_rate": 5, "exit_burn_rate": 2,
             "actions": {"shed_below_priority": 5}}]}, format="json"))
    _created(admin.post("/api/v1/deployments/chat/degradation/override/",
                        {"level": 1, "until": "30m", "reason": "drill"}, format="json"))
    return {
        ("models", "name"): "tiny", ("versions", "number"): 1, ("aliases", "alias"): "champion",
        ("deployments", "name"): "chat", ("rollouts", "rollout_id"): rollout["id"], ("slos", "pk"): slo["id"],
        ("alerts", "pk"): alert.pk, ("tenants", "name"): "acme", ("keys", "prefix"): key["prefix"],
        ("receivers", "pk"): receiver["id"], ("routes", "pk"): route["id"], ("schedules", "name"): "primary",
        ("overrides", "pk"): override["id"], ("escalation-policies", "name"): "chat-oncall",
        ("silences", "pk"): silence["id"], ("integrations", "pk"): integration["id"], ("prices", "pk"): price["id"],
        ("budgets", "pk"): budget["id"],
    }


def _api_urls() -> list[tuple[str, str]]:
    """(url name, route) for every URL under api/v1/, in URLconf order."""
    found = []

    def walk(resolver, prefix):
        for pattern in resolver.url_patterns:
            if isinstance(pattern, URLResolver):
                walk(pattern, prefix + str(pattern.pattern))
            elif (route := prefix + str(pattern.pattern)).startswith("api/v1/"):
                found.append((pattern.name, route))

    walk(get_resolver(), "")
    return found


def _path(route: str, ids: dict, missing: bool = False) -> str:
    """The route with the objects' ids in; `missing`: the last one is an object that does not exist."""
    converters = list(re.finditer(r"<(?:(\w+):)?(\w+)>", route))

    def value(match):
        if missing and match.start() == converters[-1].start():
            return "999999" if match.group(1) == "int" else "nope"
        before = route[:match.start()].rstrip("/").rsplit("/", 1)[-1]
        assert (before, match.group(2)) in ids, f"no object for {match.group(0)} after {before}/ in {route}"
        return str(ids[before, match.group(2)])

    return "/" + re.sub(r"<(?:(\w+):)?(\w+)>", value, route)


def _answer(response, method: str) -> dict:
    """What a client can tell apart, less what changes from run to run (ids, times, tokens)."""
    answer: dict[str, object] = {"status": response.status_code}
    if method == "options":
        answer["allow"] = sorted(m.strip() for m in response.get("Allow", "").split(",") if m.strip())
        if response.status_code == 200:  # less the view's name and description: wording, as in the schema test
            answer["options"] = {k: v for k, v in json.loads(response.content).items() if k not in WORDING}
    elif method != "head" and response.content and response.get("Content-Type", "").startswith("application/json"):
        body = json.loads(response.content)
        if response.status_code >= 400:
            answer["body"] = body
        elif isinstance(body, dict):
            answer["keys"] = sorted(body)
        elif isinstance(body, list):
            answer["keys"] = ["[list]", *(sorted(body[0]) if body and isinstance(body[0], dict) else [])]
    return answer


def _matrix(api, names: set[str] | None = None) -> dict[str, dict]:
    """The answers for every URL under /api/v1/, or only those whose URL name is in `names`."""
    clients = {}
    for role in ROLES:
        clients[role] = api(role)
        clients[role].raise_request_exception = False  # a server error is recorded as its 500, not raised
    ids = _objects(api)
    matrix = {}
    for name, route in _api_urls():
        if names is not None and name not in names:
            continue
        paths = {name: _path(route, ids)}
        if "<" in route:
            paths[f"{name}(missing)"] = _path(route, ids, missing=True)
        for label, path in paths.items():
            for role in ROLES:
                for method in METHODS:
                    call = getattr(clients[role], method)
                    with transaction.atomic():
                        if method in ("get", "head"):
                            response = call(path)
                        else:
                            response = call(path, {}, format="json")
                        transaction.set_rollback(True)
                    matrix[f"{label} {method.upper()} {role or 'anonymous'}"] = _answer(response, method)
    return matrix


def test_every_url_answers_every_method_and_role_as_before_the_viewsets(api, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    if target := os.environ.get("INFEROPS_WRITE_MATRIX"):
        live = _matrix(api)
        lines = (f"{json.dumps(key)}: {json.dumps(answer, sort_keys=True)}" for key, answer in sorted(live.items()))
        Path(target).write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one answer a line, for readable diffs
        return
    before = json.loads(SNAPSHOT.read_text())
    live = _matrix(api, {key.split(" ", 1)[0].removesuffix("(missing)") for key in before})
    assert sorted(live) == sorted(before), "the URLs, methods or roles differ from the snapshot's"
    differences = []
    for key, answer in live.items():
        expected = before[key]
        if key in CHANGED:
            was, now, _why = CHANGED[key]
            assert expected == was, f"{key}: the snapshot no longer says {was}"
            expected = now
        if _without_added(answer) != _without_added(expected):
            differences.append(f"{key}: before {expected}, now {answer}")
    assert not differences, "\n".join(differences)
