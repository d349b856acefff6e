"""A person's view of the registry in a real Chromium: log in, list, search, open a model."""

from __future__ import annotations

import os

import pytest
from django.contrib.auth.models import Group, User

from registry import services
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def registry_data(tiny_llama_dir):
    admin = User.objects.create_superuser("root-admin", password="pw-admin-123456")
    admin.groups.add(Group.objects.get(name="admin"))
    viewer = User.objects.create_user("watcher", password="pw-viewer-123456")
    viewer.groups.add(Group.objects.get(name="viewer"))
    model = services.model_create(name="llama-tiny", task="generate", actor=admin,
                                  owner="ml-platform", tags=["chat"], description="A tiny test model.")
    services.model_create(name="minilm", task="embed", actor=admin)
    services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=admin)
    version = services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=admin)
    services.alias_set(model=model, name="champion", version=version, actor=admin)
    return version


def test_admin_browses_models(live_server, page, registry_data, tmp_path):
    log_in(page, live_server.url, "root-admin", "pw-admin-123456")
    page.click("header nav >> text=Models")
    rows = page.locator("#models tbody tr")
    assert rows.count() == 2
    row = rows.filter(has_text="llama-tiny")
    assert "v2" in row.inner_text() and "LlamaForCausalLM" in row.inner_text()
    assert "champion → v2" in row.inner_text()
    assert "chat" in row.inner_text()

    page.select_option("select[name=task]", "embed")
    page.click("form.filters button")
    assert page.locator("#models tbody tr").all_inner_texts()[0].startswith("minilm")
    page.fill("input[name=q]", "nothing-like-this")
    page.click("form.filters button")
    assert "No models match this search" in page.locator("#models").inner_text()

    page.goto(f"{live_server.url}/models/")
    page.click("text=llama-tiny")
    page.wait_for_url(f"{live_server.url}/models/llama-tiny/")
    assert page.locator("h1").inner_text() == "llama-tiny"
    versions = page.locator("#versions tbody tr")
    assert versions.count() == 2
    newest = versions.nth(0).inner_text()
    assert "v2" in newest and "champion" in newest
    assert f"{registry_data.parameter_count:,}" in newest
    assert registry_data.digest[:12] in newest
    assert "4 / 2" in newest  # attention heads / KV heads
    assert "champion" in page.locator("#aliases").inner_text()
    audit = page.locator("table.audit").inner_text()
    assert "version.register" in audit and "alias.set" in audit and "root-admin" in audit
    page.screenshot(path=str(os.environ.get("INFEROPS_SCREENSHOT_DIR", tmp_path)) + "/model-detail.png",
                    full_page=True)

    page.click("header nav >> text=Audit")
    assert "model.create" in page.locator("table.audit").inner_text()
    page.click("header nav >> text=Deployments")
    assert "Deployments" in page.locator("h1").inner_text()

    page.click("text=Log out")
    page.wait_for_url(f"{live_server.url}/login/")


def test_viewer_sees_no_audit_link_and_is_refused(live_server, page, registry_data):
    log_in(page, live_server.url, "watcher", "pw-viewer-123456")
    assert page.locator("header nav >> text=Audit").count() == 0
    assert "viewer" in page.locator("header .who").inner_text()
    response = page.goto(f"{live_server.url}/audit/")
    assert response.status == 403


def test_wrong_password_says_so(live_server, page, registry_data):
    log_in(page, live_server.url, "watcher", "wrong-password", succeeds=False)
    assert "didn't match" in page.content()
    response = page.goto(f"{live_server.url}/models/")
    assert page.url.startswith(f"{live_server.url}/login/") and response.status == 200
