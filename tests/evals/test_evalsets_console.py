"""Eval sets in the console: the list with each set's latest version and last score, a set's page with
its versions and first cases, and for operators the forms that add a set and upload a version, a bad
file refused with every bad line shown and nothing stored."""

from __future__ import annotations

import hashlib
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from evals.choices import RunStatus, TargetKind
from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.sets import services
from inferops.models import AuditEvent
from registry import services as registry_services
from tests.conftest import text_of

pytestmark = pytest.mark.django_db

GOOD = (b'{"id": "sum", "prompt": "2+2=", "expected": "4"}\n'
        b'{"id": "pick", "prompt": "Sky colour?", "scorer": "choice", "choices": [" blue", " green"], "answer": 0}\n')


@pytest.fixture
def eval_set():
    return services.evalset_create(name="smoke", scorer="exact", actor=None, description="arithmetic")


def post_file(client, raw: bytes, name="smoke", filename="cases.jsonl", **kwargs):
    return client.post(f"/evals/sets/{name}/versions/new/", {"file": SimpleUploadedFile(filename, raw)}, **kwargs)


def row_of(response, row_id: str) -> str:
    """One table row's HTML, by its id."""
    return re.search(rf'<tr id="{row_id}">(.*?)</tr>', response.content.decode(), re.S).group(1)


def words(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def stored_counts():
    return EvalSetVersion.objects.count(), AuditEvent.objects.filter(action="evalset.version.upload").count()


def test_a_viewer_reads_but_sees_no_forms_and_is_refused(client, make_user, eval_set):
    client.force_login(make_user("viewer"))
    page = client.get("/evals/")
    assert page.status_code == 200
    assert 'id="set-form"' not in page.content.decode() and "smoke" in text_of(page)
    assert re.search(r'<a href="/evals/"\s+class="active">Evals</a>', page.content.decode())
    detail = client.get("/evals/sets/smoke/").content.decode()
    assert 'id="upload-form"' not in detail
    assert client.post("/evals/sets/new/", {"name": "other", "scorer": "exact"}).status_code == 403
    assert post_file(client, GOOD).status_code == 403
    assert not EvalSetVersion.objects.exists() and EvalSet.objects.count() == 1


def test_an_operator_adds_a_set(client, make_user):
    registry_services.model_create(name="chat", task="generate", actor=None)
    client.force_login(make_user("operator"))
    assert 'id="set-form"' in client.get("/evals/").content.decode()
    response = client.post("/evals/sets/new/", {"name": "smoke", "scorer": "choice", "description": "mc",
                                                 "default_for": ["chat"]}, follow=True)
    assert response.redirect_chain[-1][0] == "/evals/sets/smoke/"
    assert "Eval set smoke added: upload its cases as JSONL." in text_of(response)
    created = EvalSet.objects.get(name="smoke")
    assert (created.scorer, [m.name for m in created.default_for.all()]) == ("choice", ["chat"])
    assert AuditEvent.objects.filter(action="evalset.create", object_id=str(created.pk)).exists()


def test_a_bad_or_taken_set_name_is_shown_beside_the_field(client, make_user, eval_set):
    client.force_login(make_user("operator"))
    response = client.post("/evals/sets/new/", {"name": "Bad Name", "scorer": "exact"})
    assert response.status_code == 400 and "Use 1-63 lowercase letters" in text_of(response)
    response = client.post("/evals/sets/new/", {"name": "smoke", "scorer": "exact"})
    assert response.status_code == 400 and "An eval set named 'smoke' already exists." in text_of(response)
    assert EvalSet.objects.count() == 1


def test_an_operator_uploads_a_version_and_reads_its_first_cases(client, make_user, eval_set):
    client.force_login(make_user("operator"))
    response = post_file(client, GOOD, follow=True)
    sha256 = hashlib.sha256(GOOD).hexdigest()
    page = text_of(response)
    assert f"Uploaded smoke v1: 2 cases, sha256 {sha256[:12]}…" in page
    version = EvalSetVersion.objects.get()
    assert (version.number, version.sha256, version.case_count) == (1, sha256, 2)
    assert "2+2=" in page and "✓ blue" in page and "Sky colour?" in page
    assert 'href="/api/v1/evalsets/smoke/versions/1/?format=jsonl"' in response.content.decode()
    # The download link works for the logged-in reader: the file as uploaded.
    assert client.get("/api/v1/evalsets/smoke/versions/1/?format=jsonl").content == GOOD


def test_a_long_version_shows_its_first_cases_and_how_many_more(client, make_user, eval_set):
    raw = b"".join(b'{"id": "c%d", "prompt": "question %d", "expected": "x"}\n' % (n, n) for n in range(12))
    services.version_upload(eval_set=eval_set, raw=raw, actor=None)
    client.force_login(make_user("viewer"))
    page = text_of(client.get("/evals/sets/smoke/"))
    assert "question 4" in page and "question 5" not in page
    assert "and 7 more" in page


def test_a_bad_file_shows_every_bad_line_and_stores_nothing(client, make_user, eval_set):
    client.force_login(make_user("operator"))
    services.version_upload(eval_set=eval_set, raw=GOOD, actor=None)
    before = stored_counts()
    raw = (b'{"id": "a", "prompt": "p", "expected": "x"}\n{"id": "a", "prompt": "q", "expected": "y"}\n'
           b'{"id": "c", "prompt": "p", "scorer": "choice", "choices": ["x", "y", "z"], "answer": 4}\nnot json\n')
    response = post_file(client, raw, filename="broken.jsonl")
    assert response.status_code == 400
    page = text_of(response)
    assert "broken.jsonl is refused and nothing was stored: 3 problems below." in page
    rows = re.findall(r'<tr class="line-error"><td class="num">(\w+)</td>', response.content.decode())
    assert rows == ["2", "3", "4"]
    assert "Duplicate id 'a': line 1 already uses it" in page
    assert "`answer` 4 is out of range: 3 choices" in page
    assert "Malformed JSON" in page
    assert stored_counts() == before


def test_an_empty_or_too_large_file_is_refused(client, make_user, eval_set, settings):
    client.force_login(make_user("operator"))
    response = post_file(client, b"\n\n")
    assert response.status_code == 400 and "The file holds no cases" in text_of(response)
    assert re.search(r'<td class="num">file</td>', response.content.decode())
    settings.INFEROPS_EVALSET_MAX_BYTES = 20
    response = post_file(client, GOOD)
    assert response.status_code == 400
    assert "The file is over 20 bytes, the limit of one version (INFEROPS_EVALSET_MAX_BYTES)" in text_of(response)
    response = client.post("/evals/sets/smoke/versions/new/", {})
    assert response.status_code == 400 and "This field is required." in text_of(response)
    assert not EvalSetVersion.objects.exists()


def test_the_list_shows_latest_version_cases_and_last_run_score(client, make_user, eval_set, tiny_llama_dir):
    model = registry_services.model_create(name="tiny", task="generate", actor=None)
    model_version = registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    services.version_upload(eval_set=eval_set, raw=GOOD, actor=None)
    latest = services.version_upload(eval_set=eval_set, raw=GOOD + b'{"id": "x", "prompt": "p", "expected": "y"}',
                                     actor=None)
    services.evalset_create(name="unused", scorer="parity", actor=None)
    now = timezone.now()
    common = {"eval_set": eval_set, "set_version": latest, "target_kind": TargetKind.VERSION,
              "model_version": model_version, "priority": -1000}
    run = EvalRun.objects.create(**common, status=RunStatus.SUCCEEDED, score=0.667, finished_at=now)
    EvalRun.objects.create(**common, status=RunStatus.FAILED, finished_at=now)  # later, but no score
    client.force_login(make_user("viewer"))
    response = client.get("/evals/")
    smoke = row_of(response, "set-smoke")
    assert "Exact match v2 3 0.667 tiny v1" in words(smoke)
    assert f'href="/evals/runs/{run.pk}/"' in smoke
    assert words(row_of(response, "set-unused")).startswith("unused Parity with a reference version none — not run")


def test_the_runs_section_shows_once_its_template_exists(client, make_user, eval_set, settings, tmp_path):
    client.force_login(make_user("viewer"))
    assert "RUNS OF" not in text_of(client.get("/evals/sets/smoke/"))
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "set_runs.html").write_text("RUNS OF {{ eval_set.name }}: {{ runs|length }}")
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [tmp_path, *settings.TEMPLATES[0]["DIRS"]]}]
    assert "RUNS OF smoke: 0" in text_of(client.get("/evals/sets/smoke/"))


def test_the_upload_form_takes_a_file_over_the_usual_body_limit(client, make_user, eval_set, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 500
    raw = b"".join(b'{"id": "c%d", "prompt": "%s", "expected": "x"}\n' % (n, b"q" * 40) for n in range(20))
    client.force_login(make_user("operator"))
    assert len(raw) > 500 and post_file(client, raw).status_code == 302
    assert EvalSetVersion.objects.get().case_count == 20
    too_long = {"name": "x", "scorer": "exact", "description": "d" * 600}
    assert client.post("/evals/sets/new/", too_long).status_code == 413  # other forms keep the usual limit


def test_the_admin_writes_sets_through_the_service_and_only_reads_versions(client, eval_set):
    from django.contrib.auth.models import User

    chat = registry_services.model_create(name="chat", task="generate", actor=None)
    client.force_login(User.objects.create_superuser("root", password="pw-12345678"))
    response = client.post("/admin/evals/evalset/add/", {"name": "mc", "scorer": "choice", "description": "",
                                                         "default_for": [chat.pk]})
    assert response.status_code == 302, response.content.decode()[:2000]
    response = client.post(f"/admin/evals/evalset/{eval_set.pk}/change/",
                           {"scorer": "regex", "description": "changed", "default_for": [chat.pk]})
    assert response.status_code == 302, response.content.decode()[:2000]
    assert [m.name for m in EvalSet.objects.get(name="mc").default_for.all()] == ["chat"]
    eval_set.refresh_from_db()
    assert (eval_set.scorer, [m.name for m in eval_set.default_for.all()]) == ("regex", ["chat"])
    events = {e.action: e for e in AuditEvent.objects.filter(actor_name="root")}
    assert set(events) == {"evalset.create", "evalset.update"}
    assert events["evalset.update"].before["default_for"] == [] and events["evalset.update"].after[
        "default_for"] == [chat.pk]
    version = services.version_upload(eval_set=eval_set, raw=GOOD, actor=None)
    assert client.get(f"/admin/evals/evalsetversion/{version.pk}/change/").status_code == 200
    assert client.get("/admin/evals/evalsetversion/add/").status_code == 403
    assert client.get("/admin/evals/evalrun/add/").status_code == 403
