"""The deployment forms in the console: create with driver, resources and autoscaling choosing the
version from a list, and a change shown as a diff that applies only once confirmed. Viewers get
no form; bad input is named on the page and nothing is written.

Reconciles are requested with transaction.on_commit; these tests run inside a transaction that
never commits, so none is queued and no replica is started.
"""

from __future__ import annotations

import html
import re

import pytest
from django.utils import timezone

from deployments.models import Deployment, Rollout
from inferops.models import AuditEvent
from registry.models import Alias, RegisteredModel
from slo.models import Slo, SloStatus
from tests.conftest import text_of
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db


@pytest.fixture
def model() -> RegisteredModel:
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    make_version(model, 1)
    v2 = make_version(model, 2)
    Alias.objects.create(model=model, name="champion", version=v2)
    return model


@pytest.fixture
def deployment(model) -> Deployment:
    return Deployment.objects.create(name="chat", model=model, version=model.versions.get(number=1), replicas=1,
                                     min_replicas=1, max_replicas=1)


@pytest.fixture
def operator(client, make_user):
    client.force_login(make_user("operator"))
    return client


def create_form(**fields) -> dict:
    return {"name": "chat", "version": "tiny:2", "backend": "builtin", "driver": "local", "replicas": "2",
            "min_replicas": "", "max_replicas": "", "cpu": "", "memory": "", "gpu_type": "", "gpu_count": "",
            "engine_args": "", **fields}


def edit_form(deployment, **fields) -> dict:
    return {"version": f"tiny:{deployment.version.number}", "replicas": str(deployment.replicas),
            "min_replicas": str(deployment.min_replicas), "max_replicas": str(deployment.max_replicas),
            "cpu": "", "memory": "", "gpu_type": "", "gpu_count": "", "engine_args": "", **fields}


def test_viewer_sees_no_forms_and_is_refused(client, make_user, deployment):
    client.force_login(make_user("viewer"))
    assert "Scale or change version" not in text_of(client.get("/deployments/chat/"))
    assert client.get("/deployments/new/").status_code == 403
    assert client.post("/deployments/new/", create_form(name="other")).status_code == 403
    assert client.post("/deployments/chat/edit/", edit_form(deployment, replicas="3")).status_code == 403
    assert Deployment.objects.count() == 1 and Deployment.objects.get().replicas == 1


def test_the_version_is_chosen_from_the_models_versions_and_aliases(operator, model):
    page = text_of(operator.get("/deployments/new/"))
    assert '<optgroup label="tiny">' in page
    assert '<option value="tiny:2">tiny v2 (champion)</option>' in page
    assert '<option value="tiny:1">tiny v1</option>' in page
    assert '<option value="tiny@champion">tiny @champion (now v2)</option>' in page


def test_operator_creates_with_driver_resources_and_autoscaling(operator, model):
    response = operator.post("/deployments/new/", create_form(
        driver="kubernetes", autoscale="on", min_replicas="1", max_replicas="4", cpu="2", memory="16Gi",
        gpu_type="nvidia-h100", gpu_count="1", engine_args='{"max_num_seqs": 8}'), follow=True)
    assert response.redirect_chain[-1][0] == "/deployments/chat/"
    created = Deployment.objects.get(name="chat")
    assert (created.version.number, created.driver, created.replicas, created.autoscale) == (2, "kubernetes", 2, True)
    assert (created.min_replicas, created.max_replicas) == (1, 4)
    assert created.resources == {"cpu": 2, "memory": "16Gi", "gpu_type": "nvidia-h100", "gpu_count": 1}
    assert created.engine_args == {"max_num_seqs": 8}
    assert "Deployment chat created: v2 on 2 replica(s)." in text_of(response)

    operator.post("/deployments/new/", create_form(name="chat-2", version="tiny@champion", cpu="500m"))
    pinned = Deployment.objects.get(name="chat-2")
    assert (pinned.version.number, pinned.alias, pinned.resources) == (2, "champion", {"cpu": "500m"})


@pytest.mark.parametrize(("fields", "expected"), [
    ({"name": "Chat_1"}, "Use 1-63 lowercase letters, digits and hyphens"),
    ({"version": ""}, "This field is required."),
    ({"version": "tiny:9"}, "Select a valid choice. tiny:9 is not one of the available choices."),
    ({"min_replicas": "3", "max_replicas": "2"}, "Minimum replicas (3) exceeds maximum replicas (2)."),
    ({"replicas": "5", "min_replicas": "2", "max_replicas": "4"},
     "Replicas (5) must lie between minimum replicas (2) and maximum replicas (4)."),
    ({"gpu_count": "-1"}, "Ensure this value is greater than or equal to 0."),
    ({"engine_args": '{"max_num_seqs": '}, "Not valid JSON"),
    ({"engine_args": '{"no_such_option": 1}'}, "no_such_option"),
    ({"replicas": "300"}, "Ensure this value is less than or equal to 256."),
])
def test_bad_input_is_named_on_the_page_and_nothing_is_written(operator, model, fields, expected):
    response = operator.post("/deployments/new/", create_form(**fields))
    assert response.status_code == 400
    page = text_of(response)
    assert expected in page
    assert "min_replicas (" not in page and "max_replicas (" not in page  # the labels' words, not the API's
    assert not Deployment.objects.exists()


def test_a_taken_name_is_a_conflict_beside_the_name(operator, deployment):
    response = operator.post("/deployments/new/", create_form())
    assert response.status_code == 400
    assert "A deployment named 'chat' already exists." in text_of(response)
    assert Deployment.objects.count() == 1


def errors_by_field(response) -> dict[str, list[str]]:
    """The errors the page shows, by the field they sit beside ("" for the form's own)."""
    page = response.content.decode()
    found = {"": [html.unescape(e) for e in re.findall(r'<li class="error"[^>]*>(.*?)</li>', page)]}
    for name, block in re.findall(r'<p class="field field-([\w]+)">(.*?)</p>', page, re.S):
        found[name] = [html.unescape(e) for e in re.findall(r'<span class="error"[^>]*>(.*?)</span>', block)]
    return found


def test_every_create_error_shows_after_one_submit(operator, deployment):
    response = operator.post("/deployments/new/", create_form(
        version="", engine_args='{"no_such_option": 1}', min_replicas="3", max_replicas="2", gpu_count="x"))
    assert response.status_code == 400
    errors = errors_by_field(response)
    assert errors["version"] == ["This field is required."]
    assert errors["name"] == ["A deployment named 'chat' already exists."]  # checked although the version is missing
    assert errors["engine_args"] == ["no_such_option: not an option of the built-in engine (see `inferops serve "
                                     "--help`)"]
    assert errors["min_replicas"] == ["Minimum replicas (3) exceeds maximum replicas (2)."]
    assert errors["gpu_count"] == ["Enter a whole number."]
    assert Deployment.objects.count() == 1 and not AuditEvent.objects.filter(action="deployment.create").exists()

    # Bad JSON beside a bad name and a missing version: all three at once.
    errors = errors_by_field(operator.post("/deployments/new/", create_form(
        name="Chat_1", version="", engine_args='{"max_num_seqs": ')))
    assert errors["name"] == ["Use 1-63 lowercase letters, digits and hyphens, starting and ending with a letter or "
                              "digit."]
    assert errors["version"] == ["This field is required."]
    assert errors["engine_args"][0].startswith("Not valid JSON")
    assert Deployment.objects.count() == 1


def test_a_reserved_name_is_named_beside_a_bad_size(operator, deployment):
    errors = errors_by_field(operator.post("/deployments/new/", create_form(name="chat--preview", replicas="300")))
    assert errors["name"] == ["Names ending in '--preview' are reserved for rollout previews."]
    assert errors["replicas"] == ["Ensure this value is less than or equal to 256."]
    assert Deployment.objects.count() == 1


def test_every_edit_error_shows_before_the_review(operator, deployment):
    response = operator.post("/deployments/chat/edit/", edit_form(
        deployment, engine_args='{"no_such_option": 1}', min_replicas="2", max_replicas="1", gpu_count="x"))
    assert response.status_code == 400 and "Review the change" not in text_of(response)
    errors = errors_by_field(response)
    assert any("no_such_option" in e for e in errors["engine_args"])
    assert errors["min_replicas"] == ["Minimum replicas (2) exceeds maximum replicas (1)."]
    assert errors["gpu_count"] == ["Enter a whole number."]
    errors = errors_by_field(operator.post("/deployments/chat/edit/", edit_form(
        deployment, engine_args="[1", min_replicas="2", max_replicas="1")))
    assert errors["engine_args"][0].startswith("Not valid JSON")
    assert errors["min_replicas"] == ["Minimum replicas (2) exceeds maximum replicas (1)."]
    deployment.refresh_from_db()
    assert (deployment.min_replicas, deployment.engine_args) == (1, {})
    assert not AuditEvent.objects.filter(action="deployment.update").exists()


def test_scaling_shows_the_diff_and_applies_only_when_confirmed(operator, deployment):
    response = operator.post("/deployments/chat/edit/", edit_form(deployment, replicas="3", version="tiny:2"))
    assert response.status_code == 200
    page = text_of(response)
    assert "Review the change to chat" in page
    assert "<td>Model version</td><td class=\"mono\">v1</td><td class=\"mono\"><strong>v2</strong>" in page
    assert "<td>Replicas</td><td class=\"mono\">1</td><td class=\"mono\"><strong>3</strong>" in page
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.version.number) == (1, 1)  # nothing applied yet
    token = re.search(r'name="confirm" value="(\w+)"', page)[1]

    # The form changed after the review: its new diff is shown, not the old one applied.
    response = operator.post("/deployments/chat/edit/", edit_form(deployment, replicas="4", version="tiny:2",
                                                                  confirm=token))
    assert "<strong>4</strong>" in text_of(response)
    deployment.refresh_from_db()
    assert deployment.replicas == 1

    response = operator.post("/deployments/chat/edit/", edit_form(deployment, replicas="3", version="tiny:2",
                                                                  confirm=token), follow=True)
    assert response.redirect_chain[-1][0] == "/deployments/chat/"
    deployment.refresh_from_db()
    assert (deployment.replicas, deployment.version.number, deployment.max_replicas) == (3, 2, 3)
    assert "chat changed: model version v1 → v2; replicas 1 → 3." in text_of(response)
    assert AuditEvent.objects.filter(action="deployment.update").count() == 1


def test_resources_autoscaling_and_alias_change_through_the_diff(operator, deployment):
    fields = edit_form(deployment, version="tiny@champion", autoscale="on", max_replicas="5", gpu_count="1",
                       gpu_type="nvidia-l4")
    page = text_of(operator.post("/deployments/chat/edit/", fields))
    assert "v2 (alias champion)" in page and "gpu_type=nvidia-l4, gpu_count=1" in page
    token = re.search(r'name="confirm" value="(\w+)"', page)[1]
    operator.post("/deployments/chat/edit/", {**fields, "confirm": token})
    deployment.refresh_from_db()
    assert (deployment.version.number, deployment.alias, deployment.autoscale, deployment.max_replicas) == (
        2, "champion", True, 5)
    assert deployment.resources == {"gpu_type": "nvidia-l4", "gpu_count": 1}


def test_edit_refusals_are_named_and_nothing_changes(operator, deployment):
    response = operator.post("/deployments/chat/edit/", edit_form(deployment))
    assert response.status_code == 400 and "Nothing to change: every value is what chat has now." in text_of(response)
    # Refused at the review already: no diff is offered for a change the service would refuse.
    response = operator.post("/deployments/chat/edit/", edit_form(deployment, min_replicas="2", max_replicas="1"))
    assert response.status_code == 400 and "Review the change" not in text_of(response)
    assert "Minimum replicas (2) exceeds maximum replicas (1)." in text_of(response)
    deployment.refresh_from_db()
    assert (deployment.min_replicas, deployment.max_replicas) == (1, 1)
    assert not AuditEvent.objects.filter(action="deployment.update").exists()


def test_a_rollout_refused_by_the_budget_offers_the_override_as_a_form(operator, deployment):
    slo = Slo.objects.create(name="chat-availability", deployment=deployment, sli_kind="availability",
                             objective=0.99)
    SloStatus.objects.create(slo=slo, budget_remaining=-0.25, state="exhausted", evaluated_at=timezone.now())
    page = text_of(operator.get("/deployments/chat/"))
    assert "rollout-override_reason" not in page  # no override offered before a refusal

    form = {"rollout-version": "2", "rollout-strategy": "canary", "rollout-steps": '[{"set_weight": 50}]',
            "rollout-engine_args": ""}
    response = operator.post("/deployments/chat/rollouts/new/", form)
    assert response.status_code == 400
    page = text_of(response)
    assert "Refused by the error-budget policy." in page
    assert "Error budget exhausted for SLO <strong>chat-availability</strong> (25% over its budget)" in page
    assert 'name="rollout-override_reason"' in page and 'id="override-start"' in page
    assert "Say why this rollout should go ahead" in page
    assert '"override_reason"' not in page and "rollback&quot;" not in page  # no API field names
    assert 'value="2" selected' in page  # the choices made are kept
    assert not Rollout.objects.exists()

    response = operator.post("/deployments/chat/rollouts/new/", {**form, "rollout-override_reason": "hotfix for #42"})
    rollout = Rollout.objects.get()
    assert response.status_code == 302 and rollout.override_reason == "hotfix for #42"
    assert AuditEvent.objects.filter(action="rollout.budget_override", object_id=str(rollout.pk)).exists()


def test_viewer_cannot_start_a_rollout(client, make_user, deployment):
    client.force_login(make_user("viewer"))
    assert 'id="start-rollout"' not in text_of(client.get("/deployments/chat/"))
    response = client.post("/deployments/chat/rollouts/new/", {"rollout-version": "2", "rollout-strategy": "canary",
                                                               "rollout-override_reason": "x"})
    assert response.status_code == 403


def test_an_empty_submission_is_refused_field_by_field_not_a_server_error(operator, deployment):
    """Issue 40 (the permissions matrix): an empty POST left the form unbound, and reading it was a 500."""
    for page in ("/deployments/new/", "/deployments/chat/edit/"):
        response = operator.post(page, {})
        assert response.status_code == 400, (page, response.status_code)
        assert "This field is required." in text_of(response), page
    assert Deployment.objects.count() == 1 and not AuditEvent.objects.exists()
