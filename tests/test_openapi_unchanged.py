"""The REST API's OpenAPI schema is the one recorded before the ViewSet move (issue 37).

tests/fixtures/openapi-before.json is `manage.py spectacular --format openapi-json` at 9f32e02, before any
hand-written APIView became a ViewSet. The live schema must match it on paths, methods, status codes,
parameters, request bodies and response bodies (field names, types, formats, enums, required, nullable,
read-only), security and tags. Ignored on purpose: operationId, summary, description and title, which a
ViewSet may name differently, and the components' names: every $ref is resolved before comparing, so
only the shape behind a name counts. Issue 38 regenerated it once, on purpose: it added the eval sets and runs,
the version comparison and an SLO's eval runs, and the `quality`, `fallbacks` and `warnings` fields, and
`quality` among the SLI kinds; every change to what was there before is such an addition (checked path by
path). Issue 39 added the five `slo_*_per_s` series to the deployment metrics' `series` enum, and nothing
else. Do not regenerate the fixture to make this pass; a deliberate API change updates it in the same commit
that makes the change, and says so, or goes into CHANGED with its reason.
"""
import json
from pathlib import Path

from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer

FIXTURE = Path(__file__).parent / "fixtures" / "openapi-before.json"
# Wording and names a ViewSet may change without changing what a client sends or receives.
IGNORED_KEYS = {"operationId", "summary", "description", "title"}
HTTP_METHODS = {"get", "put", "post", "patch", "delete", "head", "options", "trace"}
# Differences made on purpose since the fixture: (operations, where in each) -> why. `where` is a fragment of
# the flattened key ("/responses/409/", "/generator_url/"); a difference of one of those operations whose key
# holds it is allowed. An entry that allows nothing fails the test, so none outlives its change.
_ALERT_OPS = ("GET /api/v1/alerts/", "GET /api/v1/alerts/{id}/", "POST /api/v1/alerts/{id}/ack/",
              "POST /api/v1/alerts/{id}/resolve/", "POST /api/v1/alerts/{id}/snooze/", "GET /api/v1/slos/{id}/status/")
_SLO_OPS = ("GET /api/v1/slos/", "GET /api/v1/slos/{id}/", "PATCH /api/v1/slos/{id}/", "POST /api/v1/slos/",
            "POST /api/v1/slos/import/")
_RUN_OPS = ("GET /api/v1/evals/runs/", "GET /api/v1/evals/runs/{run_id}/", "POST /api/v1/evals/runs/",
            "POST /api/v1/evals/runs/{run_id}/cancel/")
_SET_VERSION_OPS = ("GET /api/v1/evalsets/{name}/versions/", "GET /api/v1/evalsets/{name}/versions/{number}/",
                    "POST /api/v1/evalsets/{name}/versions/")
CHANGED: dict[tuple[tuple[str, ...], str], str] = {
    (_ALERT_OPS, "/generator_url/"): "issue 40: an alert's generator_url is a URL or empty (\"\" is no URI)",
    (_SLO_OPS, "/runbook_url/"): "issue 40: an SLO's runbook_url is a URL or empty (\"\" is no URI)",
    (_RUN_OPS, "/reference/"): "issue 40: a run's reference is null when the scorer is not parity",
    (_RUN_OPS, "/model_version/"): "issue 40: a run's model_version may be null, as its column may",
    (_SET_VERSION_OPS, "/created_by/"): "issue 40: a set version uploaded by no user has created_by null",
    (("GET /api/v1/receivers/", "GET /api/v1/integrations/"), "/responses/4"):
        "issue 40: the admin-only lists name their 401 and 403 (and the shared 400 and 404)",
    (("POST /api/v1/slos/import/",), "/responses/4"):
        "issue 40: the OpenSLO import names its 401, 403 (and 404), and a 400 with `detail` alone",
    (("POST /api/v1/evalsets/{name}/versions/",), "/responses/400/"):
        "issue 40: a form without `file` answers DRF's field errors, as the description said, so `errors` is optional",
    (("DELETE /api/v1/receivers/{id}/",), "/responses/409/"): "issue 40: a receiver a route still sends to is a 409",
    (("PATCH /api/v1/deployments/{name}/",), "/responses/409/"):
        "issue 40: a deployment whose rollout is progressing is a 409",
    (("GET /api/v1/usage/",), "/responses/200/"):
        "issue 41: the usage buckets and totals add the offline batches' batch_* counters",
    (("GET /api/v1/costing/list-prices/", "POST /api/v1/costing/list-prices/"), "/batch_discount_percent/"):
        "issue 41: a list price's batch discount (optional on create, 50 by default)",
    (("GET /api/v1/deployments/", "POST /api/v1/deployments/", "GET /api/v1/deployments/{name}/",
      "PATCH /api/v1/deployments/{name}/", "DELETE /api/v1/deployments/{name}/"), "/properties/status/"):
        "issue 42: a deployment's status may be `parked` (scaled to zero by its autoscaler)",
    (("GET /api/v1/deployments/{name}/replicas/",), "/responses/200/"):
        "issue 42: each replica's latest start and the seconds of its cold start's phases (`cold_start`, required)",
    (("GET /api/v1/deployments/{name}/metrics/",), "/parameters/query:series/"):
        "issue 43: the GPU series (gpu_utilization, gpu_memory_used, gpu_memory_total) and mfu in the series enum",
    (("GET /api/v1/costing/report/",), "/responses/200/"):
        "issue 43: the report's GPU-hours, busy GPU-hours, busy share (null: not measured) and GPU-hours not measured",
}
# Operations added since the fixture (operation -> why): the fixture has no "before" to compare them with; an
# entry the live schema lacks fails the test.
ADDED_OPERATIONS: dict[str, str] = {
    "GET /api/v1/deployments/{name}/cold-starts/": "issue 42: a deployment's replica starts, phase by phase",
    "GET /api/v1/deployments/{name}/autoscaling/": "issue 42: a deployment's autoscaling policy and decisions",
    "PUT /api/v1/deployments/{name}/autoscaling/": "issue 42: replace a deployment's autoscaling policy",
    "GET /api/v1/deployments/{name}/autoscaling/decisions/": "issue 42: the autoscaler's decisions",
    "GET /api/v1/capacity/curves/": "issue 42: goodput curves",
    "POST /api/v1/capacity/curves/": "issue 42: store a goodput curve (inferops bench --save-curve)",
    "GET /api/v1/capacity/curves/{id}/": "issue 42: one goodput curve",
    "GET /api/v1/capacity/plan/": "issue 42: the capacity planner",
    "GET /api/v1/deployments/{name}/capacity-runs/": "issue 42: a deployment's capacity runs",
    "POST /api/v1/deployments/{name}/capacity-runs/": "issue 42: start a capacity run",
    "GET /api/v1/deployments/{name}/capacity-runs/{run_id}/": "issue 42: one capacity run",
}


def _allowed(name: str, key: str, used: set) -> bool:
    for entry in CHANGED:
        operations, where = entry
        if name in operations and where in key:
            used.add(entry)
            return True
    return False


def _resolve(node, components, stack=()):
    """The node with every $ref replaced by what it names, wording dropped, `required` in a fixed order."""
    if isinstance(node, list):
        return [_resolve(item, components, stack) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        if name in stack:  # a recursive schema: compare the recursion, not an endless expansion
            return {"$recursive": stack.index(name)}
        rest = {k: v for k, v in node.items() if k != "$ref"}
        resolved = _resolve(components[name], components, (*stack, name))
        return {**resolved, **_resolve(rest, components, stack)} if rest else resolved
    out = {}
    for key, value in node.items():
        if key in IGNORED_KEYS:
            continue
        if key == "required" and isinstance(value, list):
            out[key] = sorted(value)
        elif key == "properties":  # field names, where "description" or "title" is a field, not wording
            out[key] = {field: _resolve(spec, components, stack) for field, spec in value.items()}
        elif key == "parameters":  # keyed by where and what, not by list position
            params = {f"{p.get('in')}:{p.get('name')}": p for p in _resolve(value, components, stack)}
            out[key] = dict(sorted(params.items()))
        else:
            out[key] = _resolve(value, components, stack)
    return out


def _operations(schema):
    """{'GET /api/v1/...': the operation with references resolved}, for every path and method."""
    components = schema.get("components", {}).get("schemas", {})
    ops = {}
    for path, item in schema["paths"].items():
        shared = item.get("parameters", [])
        for method, op in item.items():
            if method not in HTTP_METHODS:
                continue
            op = {**op, "parameters": [*shared, *op.get("parameters", [])]}
            ops[f"{method.upper()} {path}"] = _resolve(op, components)
    return ops


def _flatten(node, prefix=""):
    if isinstance(node, dict):
        if not node:
            return {prefix: {}}
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}/{key}"))
        return out
    if isinstance(node, list):
        if not node:
            return {prefix: []}
        out = {}
        for i, value in enumerate(node):
            out.update(_flatten(value, f"{prefix}[{i}]"))
        return out
    return {prefix: node}


def _live_schema():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    # The same rendering `manage.py spectacular` wrote the fixture with (lazy strings, decimals, enums).
    return json.loads(OpenApiJsonRenderer().render(schema, renderer_context={}))


def test_openapi_schema_is_unchanged_by_the_viewset_move():
    before = _operations(json.loads(FIXTURE.read_text()))
    now = _operations(_live_schema())

    assert set(ADDED_OPERATIONS) <= set(now), f"ADDED_OPERATIONS not in the schema: {set(ADDED_OPERATIONS) - set(now)}"
    assert sorted(set(now) - set(ADDED_OPERATIONS)) == sorted(before), "operations added or removed"
    differences, used = [], set()
    for name in sorted(before):
        old, new = _flatten(before[name]), _flatten(now[name])
        for key in sorted(old.keys() | new.keys()):
            if old.get(key, "<absent>") != new.get(key, "<absent>") and not _allowed(name, key, used):
                differences.append(f"{name} {key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
    assert not differences, f"{len(differences)} differences:\n" + "\n".join(differences[:40])
    assert set(CHANGED) == used, f"CHANGED entries that allow nothing: {set(CHANGED) - used}"


def test_the_comparison_sees_a_changed_field():
    # Guards the test above against comparing nothing: a renamed response field must be caught.
    schema = json.loads(FIXTURE.read_text())
    before = _operations(schema)
    version = schema["components"]["schemas"]["Version"]["properties"]
    version["digest_renamed"] = version.pop("digest")
    changed = _operations(schema)
    assert changed["POST /api/v1/models/{name}/versions/"] != before["POST /api/v1/models/{name}/versions/"]
