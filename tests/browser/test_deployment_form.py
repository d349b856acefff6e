"""The deployment form in a real Chromium: one submit names every problem beside its field (what the
form reads, what the API's serializer and the deployment service judge), and nothing is written."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

from deployments.models import Deployment
from inferops.models import AuditEvent
from registry.models import RegisteredModel
from tests.browser.conftest import log_in
from tests.deployments.conftest import make_version

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def taken_name(settings):
    """An operator, a model with two versions, and a deployment already named "chat"."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("ops", password="pw-ops-123456").groups.add(Group.objects.get(name="operator"))
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    make_version(model, 2)
    return Deployment.objects.create(name="chat", model=model, version=make_version(model, 1), replicas=1)


def submit(page, **fields: str) -> None:
    for field, value in fields.items():
        page.fill(f"#id_{field}", value)
    page.click("#save")


def field_errors(page, field: str) -> list[str]:
    return page.locator(f"#deployment-form .field-{field} .error").all_inner_texts()


def test_one_submit_shows_every_error_of_the_deployment_form(live_server, page, page_errors, taken_name):
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/new/")

    # A taken name, no version chosen, an engine key the engine does not have, bounds the wrong way round.
    submit(page, name="chat", engine_args='{"no_such_option": 1}', min_replicas="3", max_replicas="2")
    page.wait_for_selector("#deployment-form .field-name .error")
    assert field_errors(page, "name") == ["A deployment named 'chat' already exists."]
    assert field_errors(page, "version") == ["This field is required."]
    assert field_errors(page, "engine_args") == [
        "no_such_option: not an option of the built-in engine (see `inferops serve --help`)"]
    assert field_errors(page, "min_replicas") == ["Minimum replicas (3) exceeds maximum replicas (2)."]
    assert page.input_value("#id_engine_args") == '{"no_such_option": 1}'  # what was typed stays

    # Engine arguments that are not JSON: named with the taken name and the missing version, at once.
    submit(page, engine_args='{"max_num_seqs": ', min_replicas="", max_replicas="")
    page.wait_for_selector("#deployment-form .field-engine_args .error >> text=Not valid JSON")
    assert field_errors(page, "name") == ["A deployment named 'chat' already exists."]
    assert field_errors(page, "version") == ["This field is required."]
    assert field_errors(page, "min_replicas") == []

    assert list(Deployment.objects.values_list("name", flat=True)) == ["chat"]
    assert not AuditEvent.objects.filter(action="deployment.create").exists()
    assert page_errors == []
