"""Property-based fuzzing of the whole REST API from its own OpenAPI schema, with schemathesis (issue 40).

The server is pytest-django's `live_server` (a threaded WSGI server in this process, on the test
database, committed rows since the tests are transactional): it serves the same URLconf, middleware and
Postgres as production, starts in no time, and lets the test seed rows and count them through the ORM
with no second process to keep in step. One object of every kind is seeded first (the ideas of
tests/test_api_status_matrix.py, plus an eval set and run), and about half the cases of an operation
with ids in its path name those rows, so they reach real objects rather than a 404.

For each role (anonymous, viewer, operator, admin) every operation under /api/v1/ gets positive and
negative cases (schemathesis's generation modes), with the role's token. Each answer must be:
- no 5xx (`not_a_server_error`);
- a status code the schema names, of the content type it names, with a body that matches the schema;
  error bodies included: every endpoint names its 4xx answers with the shared `Error` component
  (inferops/api.py, ERRORS) or one of its own (an eval set's bad lines, OpenSLO's unsupported fields), so
  schemathesis checks them; and since `Error` allows any field, a check of our own holds a body the schema
  calls `Error` to DRF's documented shape too (`{"detail": "..."}` or, per field, a list of messages or
  nested errors). The YAML downloads (an SLO as OpenSLO, its Prometheus rules) are described as text
  (`type: string`), so they are read as text: an OpenSLO export is several YAML documents, which no single
  deserialized value could be;
- for anonymous, a 401 (or the 404 of a URL no view matches, such as a word for an integer id);
- for a refused request (4xx), not a row written or removed: the row count of every table
  (django.apps.apps.get_models, many-to-many tables included) is the same before and after.
Failures are gathered, not raised at the first, so one run lists every defect it met.

The short pass (in `make test`) sends 2 cases an operation and role (1 for anonymous), derandomized so
it sends the same ones each run. The long pass (`make fuzz`) sends a few thousand, then runs the
stateful test for each signed-in role: drf-spectacular writes no OpenAPI links, so the links are the ones
schemathesis infers from the schema (a created object's name or id fed to the operations on it: several
hundred transitions), and `schema.as_state_machine()` walks them. No scenario resets the server, so hypothesis
may stop a walk whose draws meet other rows than before (FlakyStrategyDefinition); the figures say so.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections import Counter, defaultdict
from urllib.parse import unquote, urlsplit

import pytest
import requests
import schemathesis
from django.apps import apps
from django.db import connection
from django.urls import Resolver404, resolve
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyStrategyDefinition
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.evals.runs_world import eval_set_with
from tests.reliability.suite import LONG, record, scaled
from tests.test_api_status_matrix import _objects
from tests.test_openapi_unchanged import _live_schema

pytestmark = [pytest.mark.fuzz, pytest.mark.django_db(transaction=True)]


# Every YAML media type (schemathesis picks the first of its family that matches).
@schemathesis.deserializer("text/yaml", "text/x-yaml", "application/x-yaml", "application/yaml")
def _yaml_as_text(ctx, response):
    return response.content.decode()


ROLES = (None, "viewer", "operator", "admin")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = scaled(2, 12)  # cases per operation and role (anonymous: half, at least one)
STATEFUL_SCENARIOS = scaled(0, 60)
# Figures of every role run so far in this session, written after each (record() keeps the last).
FIGURES: dict[str, dict] = {}


def _table_counts_sql() -> str:
    tables = sorted({model._meta.db_table for model in apps.get_models(include_auto_created=True)
                     if model._meta.managed and not model._meta.proxy})
    return "SELECT " + ", ".join(f'(SELECT count(*) FROM "{table}") AS "{table}"' for table in tables)


def _row_counts(sql: str) -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(sql)
        names = [column.name for column in cursor.description]
        return dict(zip(names, cursor.fetchone(), strict=True))


def _drf_error_shape(body: object) -> str | None:
    """Why a 4xx body is not DRF's error shape, or None."""
    if not isinstance(body, dict) or not body:
        return f"not an object with fields: {body!r}"[:200]
    if "detail" in body and not isinstance(body["detail"], str):
        return f"`detail` is not a string: {body['detail']!r}"[:200]

    def messages(value) -> bool:
        if isinstance(value, str):
            return True
        if isinstance(value, list):
            return all(messages(item) for item in value)
        if isinstance(value, dict):
            return all(messages(item) for item in value.values())
        return False

    bad = [field for field, value in body.items() if field != "detail" and not messages(value)]
    return f"fields without messages: {bad}" if bad else None


def _no_view(response) -> bool:
    """Whether the URL sent matches no view (`/api/v1/alerts/abc/` for an integer id): a 404 before any
    view, so before authentication, is the only answer such a URL has."""
    try:
        resolve(unquote(urlsplit(response.request.url).path))
    except Resolver404:
        return True
    return False


def _documented_as_error(operation, status: int) -> bool:
    """Whether the schema names the shared `Error` component for this answer."""
    documented = operation.definition.raw.get("responses", {}).get(str(status), {})
    schema = documented.get("content", {}).get("application/json", {}).get("schema", {})
    return schema.get("$ref", "").endswith("/Error")


@functools.cache
def _schema_in_process():
    return schemathesis.openapi.from_dict(_live_schema())


def assert_answer_matches_schema(response, method: str, path: str) -> None:
    """A DRF test client's answer, judged by the fuzzer's checks against operation `method path` of the live
    schema: for the regression tests of what the fuzzer found, which need no live server."""
    sent = response.request["PATH_INFO"]
    answer = schemathesis.Response(
        status_code=response.status_code, headers={k.lower(): [v] for k, v in response.headers.items()},
        content=response.content, request=requests.Request(method, f"http://testserver{sent}").prepare(),
        elapsed=0.0, message="", encoding="utf-8", http_version="1.1", verify=True)
    operation = _schema_in_process()[path][method]
    template = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(path))
    case = operation.Case(path_parameters=re.fullmatch(template, sent).groupdict())
    case.validate_response(answer, checks=CHECKS)
    if 400 <= response.status_code < 500 and _documented_as_error(operation, response.status_code):
        assert _drf_error_shape(response.json()) is None, response.content


def _seed(api, monkeypatch) -> dict[tuple[str, str], object]:
    """One object of each kind; {(collection, path parameter): value} as the status matrix keys them."""
    # Not the matrix's ids from 1001: here rows are committed, and the groups the flush after this test
    # recreates would take 1001-1003, where a later test that sets the sequences back creates its rows.
    monkeypatch.setattr("tests.test_api_status_matrix._same_ids_every_run", lambda: None)
    ids = _objects(api)
    eval_set_with([{"id": "a", "prompt": "one two", "expected": "three"}], name="smoke")
    run = api("admin").post("/api/v1/evals/runs/", {"eval_set": "smoke", "target": {"deployment": "chat"}},
                            format="json")
    assert run.status_code == 202, run.content
    return {**ids, ("evalsets", "name"): "smoke", ("runs", "run_id"): run.json()["id"]}


def _seeded_path(path: str, ids: dict) -> dict[str, object]:
    """The path parameters that name seeded rows, e.g. {"name": "chat", "rollout_id": 1001}."""
    values = {}
    for match in re.finditer(r"\{(\w+)\}", path):
        before = path[:match.start()].rstrip("/").rsplit("/", 1)[-1]
        name = match.group(1)
        for key in ((before, name), (before, "pk")):
            if key in ids:
                values[name] = ids[key]
                break
    return values


class Fuzzer:
    """Sends cases as one role and judges each answer; gathers failures instead of raising them."""

    def __init__(self, base_url: str, role: str | None, token: str | None) -> None:
        self.base_url = base_url
        self.role = role or "anonymous"
        self.headers = {"Authorization": f"Token {token}"} if token else {}
        self.session = requests.Session()
        self.counts_sql = _table_counts_sql()
        self.cases = 0
        self.by_class: Counter[str] = Counter()
        self.operations: set[str] = set()
        self.failures: dict[str, str] = {}  # "METHOD path: kind" -> the first example

    def send(self, case) -> schemathesis.Response:
        if not self.headers:  # anonymous: no credentials of any kind, whatever the case generated
            for header in [h for h in (case.headers or {}) if h.lower() in ("authorization", "cookie")]:
                del case.headers[header]
        before = _row_counts(self.counts_sql)
        response = case.call(base_url=self.base_url, session=self.session, headers=self.headers, timeout=60)
        after = _row_counts(self.counts_sql)
        status = response.status_code
        label = f"{case.method} {case.operation.path}"
        self.cases += 1
        self.operations.add(label)
        self.by_class[f"{status // 100}xx"] += 1
        problems: dict[str, str] = {}
        try:
            case.validate_response(response, checks=CHECKS, headers=self.headers,
                                   transport_kwargs={"base_url": self.base_url, "headers": self.headers})
        except FailureGroup as group:
            for failure in group.exceptions:
                problems[failure.title] = failure.message
        if self.role == "anonymous" and status != 401 and not (status == 404 and _no_view(response)):
            problems["anonymous not refused"] = f"answered {status}, not 401"
        if 400 <= status < 500:
            if changed := {t: (before[t], after[t]) for t in before if before[t] != after[t]}:
                problems["half-written"] = f"a {status} changed row counts {changed}"
            json_body = "json" in response.headers.get("content-type", [""])[0] and response.content
            if json_body and _documented_as_error(case.operation, status):
                if why := _drf_error_shape(json.loads(response.content)):
                    problems["error body not DRF's shape"] = why
        for kind, message in problems.items():
            self.failures.setdefault(f"{label}: {kind}", (
                f"{self.role}: {message}\n  answered {status}: {response.content[:300]!r}\n"
                f"  {case.as_curl_command(headers=self.headers)}"))
        return response

    def figures(self) -> dict:
        return {"operations_covered": len(self.operations), "cases": self.cases,
                "answers_by_status_class": dict(sorted(self.by_class.items())),
                "failures_found": len(self.failures), "failures": sorted(self.failures)}


def _operations(schema) -> list:
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if op.path.startswith("/api/v1/")]
    # Deletes last: an admin deleting the seeded deployment first would leave the rest little to reach.
    return sorted(operations, key=lambda op: op.method.upper() == "DELETE")


def _settings(examples: int) -> hypothesis_settings:
    return hypothesis_settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                               phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _fuzz_operation(fuzzer: Fuzzer, operation, seeded: dict, examples: int) -> None:
    strategies = [operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    if seeded:
        strategies += [operation.as_strategy(mode, path_parameters=seeded)
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]

    @_settings(examples)
    @given(case=st.one_of(strategies))
    def fuzz(case):
        fuzzer.send(case)

    fuzz()


def _stateful(fuzzer: Fuzzer, schema) -> dict:
    """Walks the inferred links; returns how many steps it sent and whether hypothesis cut the walk short."""

    class Workflow(schema.as_state_machine()):
        def call(self, case, **kwargs):
            return fuzzer.send(case)

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            pass  # send() judged it

    before = fuzzer.cases
    try:
        Workflow.run(settings=hypothesis_settings(_settings(STATEFUL_SCENARIOS), stateful_step_count=12,
                                                  phases=[Phase.generate]))
        cut_short = False
    except FlakyStrategyDefinition:
        # No scenario resets the server, so the same draws can meet other rows (a bundle empty this time) and
        # hypothesis stops. The steps sent until then were judged like any other case.
        cut_short = True
    return {"steps": fuzzer.cases - before, "cut_short": cut_short}


@pytest.mark.timeout(scaled(300, 1800))
@pytest.mark.parametrize("role", ROLES, ids=[role or "anonymous" for role in ROLES])
def test_every_operation_answers_as_its_schema_says_and_refusals_write_nothing(role, live_server, api, settings,
                                                                              monkeypatch):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    started = time.monotonic()
    ids = _seed(api, monkeypatch)
    token = Token.objects.get(user__username=f"{role}-api").key if role else None
    schema = schemathesis.openapi.from_url(f"{live_server.url}/api/schema/")
    fuzzer = Fuzzer(live_server.url, role, token)
    examples = EXAMPLES if role else max(1, EXAMPLES // 2)
    for operation in _operations(schema):
        _fuzz_operation(fuzzer, operation, _seeded_path(operation.path, ids), examples)
    stateful = _stateful(fuzzer, schema) if LONG and role else None

    FIGURES[fuzzer.role] = {**fuzzer.figures(), "stateful": stateful, "seconds": round(time.monotonic() - started, 1)}
    totals: defaultdict[str, int] = defaultdict(int)
    for figures in FIGURES.values():
        for status_class, count in figures["answers_by_status_class"].items():
            totals[status_class] += count
    record("rest_fuzz", {
        "operations_covered": max(f["operations_covered"] for f in FIGURES.values()),
        "cases_per_role": {name: f["cases"] for name, f in FIGURES.items()},
        "answers_by_status_class": dict(sorted(totals.items())),
        "failures_found": sum(f["failures_found"] for f in FIGURES.values()),
        "roles": FIGURES})
    assert not fuzzer.failures, f"{len(fuzzer.failures)} failures as {fuzzer.role}:\n" + "\n".join(
        f"- {key}\n  {example}" for key, example in sorted(fuzzer.failures.items()))

