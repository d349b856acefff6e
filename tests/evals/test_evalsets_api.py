"""The eval sets' REST API as CI uses it: roles, sets, versions uploaded as JSONL (a body or a multipart
file) with their sha256, every bad file refused whole naming its lines, size limits, immutability,
and concurrent uploads."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection
from drf_spectacular.generators import SchemaGenerator

from evals.models import EvalSet, EvalSetVersion
from inferops.models import AuditEvent
from registry import services as registry_services
from tests.evals.runs_world import eval_set_with
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db

URL = "/api/v1/evalsets/"
NDJSON = "application/x-ndjson"
GOOD = (b'{"id": "q1", "prompt": "2+2=", "expected": "4"}\n'
        b'{"id": "q2", "prompt": "Pick one", "scorer": "choice", "choices": [" yes", " no"], "answer": 1}\n')


def create_set(client, name="smoke", scorer="exact", **extra):
    return client.post(URL, {"name": name, "scorer": scorer, **extra}, format="json")


def upload(client, raw: bytes, name="smoke"):
    return client.generic("POST", f"{URL}{name}/versions/", raw, content_type=NDJSON)


def upload_file(client, raw: bytes, name="smoke", filename="cases.jsonl"):
    return client.post(f"{URL}{name}/versions/", {"file": SimpleUploadedFile(filename, raw)}, format="multipart")


def stored_counts():
    return EvalSetVersion.objects.count(), AuditEvent.objects.filter(action="evalset.version.upload").count()


@pytest.fixture
def operator(api):
    client = api("operator")
    assert create_set(client).status_code == 201
    return client


def test_no_credentials_is_401_reading_is_for_viewers_and_writing_for_operators(api):
    assert api(None).get(URL).status_code == 401
    viewer = api("viewer")
    assert viewer.get(URL).status_code == 200
    response = create_set(viewer)
    assert response.status_code == 403 and "operator" in response.json()["detail"]
    operator = api("operator")
    assert create_set(operator).status_code == 201
    assert upload(viewer, GOOD).status_code == 403
    assert viewer.patch(f"{URL}smoke/", {"description": "x"}, format="json").status_code == 403
    assert upload(operator, GOOD).status_code == 201
    assert viewer.get(f"{URL}smoke/versions/1/").status_code == 200
    assert EvalSetVersion.objects.count() == 1


def test_create_read_and_change_a_set(api):
    client = api("operator")
    registry_services.model_create(name="chat", task="generate", actor=None)
    registry_services.model_create(name="coder", task="generate", actor=None)
    response = create_set(client, description="arithmetic", default_for=["chat"])
    assert response.status_code == 201, response.content
    assert response.json() | {"created_at": None, "updated_at": None} == {
        "name": "smoke", "description": "arithmetic", "scorer": "exact", "default_for": ["chat"],
        "latest_version": None, "created_at": None, "updated_at": None}
    response = client.patch(f"{URL}smoke/", {"scorer": "regex", "default_for": ["chat", "coder"]}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["scorer"], sorted(response.json()["default_for"])) == ("regex", ["chat", "coder"])
    assert client.get(f"{URL}smoke/").json()["scorer"] == "regex"
    assert [s["name"] for s in client.get(URL).json()["results"]] == ["smoke"]
    events = AuditEvent.objects.filter(object_type="evals.evalset").order_by("id")
    assert [e.action for e in events] == ["evalset.create", "evalset.update"]
    assert len(events[1].after["default_for"]) == 2 and len(events[1].before["default_for"]) == 1


@pytest.mark.parametrize(("body", "field"), [
    ({"name": "Not A Slug", "scorer": "exact"}, "name"),
    ({"name": "ok", "scorer": "fuzzy"}, "scorer"),
    ({"name": "ok"}, "scorer"),
    ({"name": "ok", "scorer": "exact", "default_for": ["no-such-model"]}, "default_for"),
    ({"name": "ok", "scorer": "exact", "scorers": "exact"}, "scorers"),
])
def test_bad_set_bodies_are_400_naming_the_field(api, body, field):
    response = api("operator").post(URL, body, format="json")
    assert response.status_code == 400 and field in response.json(), response.content
    assert not EvalSet.objects.exists()


def test_a_taken_name_is_a_conflict(operator):
    response = create_set(operator)
    assert response.status_code == 409 and "already exists" in response.json()["detail"]


def test_upload_as_a_body_and_as_a_file_with_sha256_and_numbering(operator):
    first = upload(operator, GOOD)
    assert first.status_code == 201, first.content
    assert {key: first.json()[key] for key in ("version", "cases", "sha256")} == {
        "version": 1, "cases": 2, "sha256": hashlib.sha256(GOOD).hexdigest()}
    raw = "\ufeff".encode() + GOOD.replace(b"\n", b"\r\n") + b'{"id": "q3", "prompt": "caf\xc3\xa9", "expected": "x"}'
    second = upload_file(operator, raw)
    assert second.status_code == 201, second.content
    assert (second.json()["version"], second.json()["cases"], second.json()["sha256"]) == (
        2, 3, hashlib.sha256(raw).hexdigest())

    listed = operator.get(f"{URL}smoke/versions/").json()["results"]
    assert [v["version"] for v in listed] == [2, 1] and "items" not in listed[0]
    detail = operator.get(f"{URL}smoke/versions/2/").json()
    assert [case["id"] for case in detail["items"]] == ["q1", "q2", "q3"]
    assert detail["items"][1] == {"id": "q2", "prompt": "Pick one", "scorer": "choice", "max_tokens": 64,
                                  "choices": [" yes", " no"], "answer": 1}
    assert detail["created_by"] == "operator-api"
    # The download is the file as uploaded, byte for byte: its sha256 is the version's.
    download = operator.get(detail["download"])
    assert download.status_code == 200 and download["Content-Type"].startswith(NDJSON)
    assert 'filename="smoke-v2.jsonl"' in download["Content-Disposition"]
    assert download.content == raw and hashlib.sha256(download.content).hexdigest() == detail["sha256"]
    assert operator.get(f"{URL}smoke/versions/1/", HTTP_ACCEPT=NDJSON).content == GOOD
    assert operator.get(f"{URL}smoke/").json()["latest_version"] == 2
    event = AuditEvent.objects.filter(action="evalset.version.upload").order_by("id").last()
    assert event.after == {"eval_set": "smoke", "number": 2, "sha256": hashlib.sha256(raw).hexdigest(),
                           "case_count": 3}


BAD_FILES = {
    "malformed JSON": (b'{"id": "a", "prompt": "p", "expected": "x"}\n{"id": "b", "prompt": \n', 2, "Malformed JSON"),
    "missing id": (b'{"prompt": "p", "expected": "x"}\n', 1, "Missing `id`"),
    "missing prompt": (b'{"id": "a", "expected": "x"}\n', 1, "Needs `prompt`"),
    "missing expected": (b'{"id": "a", "prompt": "p"}\n', 1, "`expected` must be a non-empty string"),
    "unknown scorer": (b'{"id": "a", "prompt": "p", "scorer": "bleu"}\n', 1, 'Unknown scorer "bleu"'),
    "answer out of range": (b'\n{"id": "a", "prompt": "p", "scorer": "choice", "choices": ["x", "y", "z"], '
                            b'"answer": 4}\n', 2, "`answer` 4 is out of range: 3 choices"),
    "duplicate id": (b'{"id": "a", "prompt": "p", "expected": "x"}\n{"id": "a", "prompt": "q", "expected": "y"}\n',
                     2, "Duplicate id 'a': line 1 already uses it"),
    "empty set": (b"\n \n", None, "The file holds no cases"),
    "invalid UTF-8": (b'{"id": "a", "prompt": "\xff", "expected": "x"}\n', 1, "Not valid UTF-8 (byte 0xff"),
    "unknown keys": (b'{"id": "a", "prompt": "p", "expected": "x", "notes": "?"}\n', 1, "Unknown keys notes"),
}


@pytest.mark.parametrize("shape", ["body", "file"])
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_every_bad_file_is_refused_with_its_line_and_nothing_stored(operator, case, shape):
    raw, line, words = BAD_FILES[case]
    upload(operator, GOOD)
    before = stored_counts()
    response = upload(operator, raw) if shape == "body" else upload_file(operator, raw)
    assert response.status_code == 400, response.content
    errors = response.json()["errors"]
    assert [error["line"] for error in errors] == [line]
    assert words in errors[0]["error"]
    assert stored_counts() == before


def test_every_bad_line_of_one_file_comes_back_at_once(operator):
    raw = b"\n".join([b'{"id": "a", "prompt": "p", "expected": "x"}', b"{oops", b'{"id": "a", "prompt": "p"}',
                      b'{"id": "c", "prompt": "p", "scorer": "nope"}'])
    response = upload(operator, raw)
    assert [error["line"] for error in response.json()["errors"]] == [2, 3, 3, 4]
    assert not EvalSetVersion.objects.exists()


def test_over_the_case_limit_is_refused_naming_the_line(operator, settings):
    settings.INFEROPS_EVALSET_MAX_CASES = 1
    response = upload(operator, GOOD)
    assert response.status_code == 400
    assert response.json()["errors"] == [{"line": 2, "error": "More than 1 cases, the limit of one version "
                                                             "(INFEROPS_EVALSET_MAX_CASES): split the set."}]


def test_over_the_size_limit_is_413_as_a_body_or_a_file(operator, settings):
    settings.INFEROPS_EVALSET_MAX_BYTES = len(GOOD) - 1
    before = stored_counts()
    for response in (upload(operator, GOOD), upload_file(operator, GOOD)):
        assert response.status_code == 413, response.content
        assert "limit of one version (INFEROPS_EVALSET_MAX_BYTES)" in response.json()["detail"]
    assert stored_counts() == before
    settings.INFEROPS_EVALSET_MAX_BYTES = len(GOOD)
    assert upload(operator, GOOD).status_code == 201


def test_uploads_take_bodies_over_the_usual_limit_up_to_their_own(operator, settings):
    # The usual limit (INFEROPS_MAX_BODY_BYTES) refuses the body before any view; the upload URL takes more.
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    settings.INFEROPS_EVALSET_MAX_BYTES = 20_000
    raw = b"".join(b'{"id": "q%d", "prompt": "%s", "expected": "x"}\n' % (n, b"p" * 100) for n in range(100))
    assert 1000 < len(raw) < 20_000
    assert upload(operator, raw).status_code == 201
    assert upload_file(operator, raw).json()["cases"] == 100
    huge = operator.post(URL, {"name": "big", "scorer": "exact", "description": "x" * 2000}, format="json")
    assert huge.status_code == 413
    way_over = upload(operator, raw * 20)
    assert way_over.status_code == 413 and "limit is 21000 bytes" in way_over.json()["detail"]


def test_versions_are_immutable(operator):
    upload(operator, GOOD)
    url = f"{URL}smoke/versions/1/"
    for method in ("put", "patch", "delete"):
        assert getattr(operator, method)(url, {"items": []}, format="json").status_code == 405
    assert operator.delete(f"{URL}smoke/").status_code == 405
    version = EvalSetVersion.objects.get()
    assert (version.case_count, version.content.encode()) == (2, GOOD)


def test_the_wrong_body_type_or_no_file_says_how_to_send(operator):
    response = operator.post(f"{URL}smoke/versions/", {"cases": []}, format="json")
    assert response.status_code == 415
    assert "application/x-ndjson" in response.json()["detail"] and "`file`" in response.json()["detail"]
    response = operator.post(f"{URL}smoke/versions/", {"other": "x"}, format="multipart")
    assert response.status_code == 400 and "file" in response.json()
    assert operator.generic("POST", f"{URL}smoke/versions/", b"", content_type=NDJSON).json() == {
        "errors": [{"line": None, "error": "The file holds no cases: write one JSON object per line."}]}
    assert not EvalSetVersion.objects.exists()


def test_unknown_sets_and_versions_are_404(operator):
    assert operator.get(f"{URL}nope/").status_code == 404
    assert upload(operator, GOOD, name="nope").status_code == 404
    assert operator.get(f"{URL}smoke/versions/9/").status_code == 404
    assert operator.get(f"{URL}smoke/versions/9/?format=jsonl").status_code == 404


def test_a_new_default_scorer_applies_to_later_uploads_only(operator):
    upload(operator, b'{"id": "a", "prompt": "p", "expected": "x"}\n')
    operator.patch(f"{URL}smoke/", {"scorer": "parity"}, format="json")
    assert upload(operator, b'{"id": "a", "prompt": "p"}\n').status_code == 201
    first, second = EvalSetVersion.objects.order_by("number")
    assert (first.items[0]["scorer"], second.items[0]["scorer"]) == ("exact", "parity")


@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_get_distinct_numbers(api):
    client = api("operator")
    create_set(client)
    token = client._credentials["HTTP_AUTHORIZATION"]
    results = []

    def worker(n):
        from rest_framework.test import APIClient

        own = APIClient()
        own.credentials(HTTP_AUTHORIZATION=token)
        raw = json.dumps({"id": f"case-{n}", "prompt": "p", "expected": "x"}).encode()
        results.append(upload(own, raw).status_code)
        connection.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [201] * 4
    assert sorted(EvalSetVersion.objects.values_list("number", flat=True)) == [1, 2, 3, 4]
    assert len(set(EvalSetVersion.objects.values_list("sha256", flat=True))) == 4


def test_the_schema_documents_uploads_and_their_refusals():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    post = schema["paths"]["/api/v1/evalsets/{name}/versions/"]["post"]
    assert set(post["requestBody"]["content"]) == {NDJSON, "multipart/form-data"}
    assert {"201", "400", "403", "413", "415"} <= set(post["responses"])
    refused_schema = post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    errors = schema["components"]["schemas"][refused_schema]["properties"]["errors"]
    line = schema["components"]["schemas"][errors["items"]["$ref"].rsplit("/", 1)[1]]["properties"]["line"]
    assert line["type"] == "integer" and line["nullable"] is True
    detail = schema["paths"]["/api/v1/evalsets/{name}/versions/{number}/"]
    assert set(detail) == {"get", "parameters"} or set(detail) == {"get"}
    assert set(detail["get"]["responses"]["200"]["content"]) == {"application/json", NDJSON}
    assert "put" not in detail and "delete" not in detail


def test_a_version_uploaded_by_no_user_and_a_form_without_a_file_answer_as_the_schema_says(api):
    # Found by the REST fuzzer (issue 40): created_by is null for a version no user uploaded (the schema said
    # string), and a form without `file` answers DRF's field errors (the schema required `errors`).
    eval_set_with([{"id": "a", "prompt": "one two", "expected": "three"}])
    version = api("viewer").get(f"{URL}smoke/versions/1/")
    assert version.json()["created_by"] is None
    assert_answer_matches_schema(version, "GET", "/api/v1/evalsets/{name}/versions/{number}/")
    no_file = api("operator").post(f"{URL}smoke/versions/", {}, format="multipart")
    assert no_file.status_code == 400 and "file" in no_file.json()
    assert_answer_matches_schema(no_file, "POST", "/api/v1/evalsets/{name}/versions/")


def test_a_stranger_asking_a_version_in_an_unknown_format_is_a_401_and_anyone_else_a_400(api):
    # Found by the REST fuzzer (issue 40): DRF negotiated `?format=` before authenticating, a 404 to anyone.
    eval_set_with([{"id": "a", "prompt": "one two", "expected": "three"}])
    url = f"{URL}smoke/versions/1/"
    stranger = api(None).get(url, {"format": "xml"})
    assert stranger.status_code == 401
    assert_answer_matches_schema(stranger, "GET", "/api/v1/evalsets/{name}/versions/{number}/")
    unknown = api("viewer").get(url, {"format": "xml"})
    assert (unknown.status_code, unknown.json()) == (400, {"format": ["One of: json, jsonl."]})
    missing = api("viewer").get(f"{URL}smoke/versions/9/", {"format": "jsonl"})
    assert (missing.status_code, missing["Content-Type"]) == (404, "application/json")
    assert api("viewer").get(url, {"format": "jsonl"})["Content-Type"].startswith("application/x-ndjson")
