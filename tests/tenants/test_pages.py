"""Console pages: a real Chromium creates a tenant and a key (secret shown once), revokes it and
sees usage charts; plain requests check roles and form validation."""

from __future__ import annotations

import hashlib
import json
import re
import time

import pytest
from django.contrib.auth.models import Group, User

from tenants import publish
from tenants.ingest import store_events
from tenants.models import ApiKey, Tenant
from tests.browser.conftest import log_in
from tests.tenants.conftest import usage_event

KEY_FORMAT = re.compile(r"^iop_[0-9a-f]{8}_[A-Za-z0-9_-]{40}$")


def user_with_role(role: str, username: str) -> User:
    user = User.objects.create_user(username, password="pw-12345678")
    user.groups.add(Group.objects.get(name=role))
    return user


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_operator_creates_a_key_sees_it_once_and_revokes_it(live_server, page, deployments, redis_conn):
    user_with_role("operator", "ops")
    log_in(page, live_server.url, "ops", "pw-12345678")
    page.click("header nav >> text=Tenants")
    assert "No tenants yet" in page.locator("#tenants").inner_text()

    page.fill("#id_name", "acme")
    page.fill("#id_rpm_limit", "0")
    page.click("#new-tenant button[type=submit]")
    assert "greater than or equal to 1" in page.locator("#new-tenant .error").first.inner_text()
    assert not Tenant.objects.exists()
    page.fill("#id_rpm_limit", "600")
    page.click("#new-tenant button[type=submit]")
    page.wait_for_url(f"{live_server.url}/tenants/acme/")
    # The expiry picker is a browser's local-time widget; the form says the moment is read as UTC.
    expiry = page.locator("#new-key-form .field-expires_at, #new-key-form").first.inner_text()
    assert "Expires at (UTC)" in expiry and "read as UTC whatever your computer's time zone" in expiry

    page.fill("#id_name", "ci")
    page.fill("#id_deployments", "chat, nope")
    page.click("#new-key-form button[type=submit]")
    assert "No deployment named 'nope'" in page.locator("#new-key-form .error").first.inner_text()
    assert not ApiKey.objects.exists()
    page.fill("#id_deployments", "chat")
    page.fill("#id_priority", "5")
    page.click("#new-key-form button[type=submit]")
    secret = page.locator("#new-key-secret").inner_text().strip()
    assert KEY_FORMAT.match(secret)
    key = ApiKey.objects.get()
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest() and key.deployments == ["chat"]
    assert redis_conn.hexists(publish.KEYS_KEY, key.key_hash)  # published when the create committed
    row = page.locator(f"#keys tr[data-prefix='{key.prefix}']")
    assert "active" in row.inner_text() and "chat" in row.inner_text()

    # Shown once: the page reached again does not carry it.
    page.goto(f"{live_server.url}/tenants/acme/")
    assert secret not in page.content() and key.prefix in page.content()

    # Tenant limits, changed from the page, reach the published key entry.
    page.click("#limits summary")
    page.fill("#id_limits-tpm_limit", "-3")
    page.click("#limits button[type=submit]")
    assert "greater than or equal to 1" in page.locator("#limits .error").first.inner_text()
    page.fill("#id_limits-tpm_limit", "5000")
    page.click("#limits button[type=submit]")
    page.wait_for_selector(".messages")
    assert Tenant.objects.get().tpm_limit == 5000
    assert json.loads(redis_conn.hget(publish.KEYS_KEY, key.key_hash))["limits"]["tenant"] == {
        "rpm": 600, "tpm": 5000, "max_concurrent": None}

    dialogs = []
    page.once("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))
    page.locator(f"#keys tr[data-prefix='{key.prefix}'] form.revoke button").click()
    page.wait_for_selector(".messages")
    assert "Revoke key" in dialogs[0]
    assert "revoked" in page.locator(f"#keys tr[data-prefix='{key.prefix}']").inner_text()
    assert not redis_conn.hexists(publish.KEYS_KEY, key.key_hash)


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_usage_charts_and_list_counts(live_server, page, redis_conn):
    user_with_role("viewer", "watcher")
    Tenant.objects.create(name="acme", tpm_limit=1000)
    now = time.time()
    store_events([usage_event(time=now - 60 * i, deployment=name, prompt_tokens=10 * i)
                  for i in range(1, 20) for name in ("chat", "embed")])
    log_in(page, live_server.url, "watcher", "pw-12345678")
    page.goto(f"{live_server.url}/tenants/")
    row = page.locator("#tenants tr[data-name='acme']").inner_text()
    assert "1000" in row and "38" in row  # tokens/min limit and last-hour requests
    assert page.locator("#new-tenant").count() == 0  # viewers get no forms

    page.goto(f"{live_server.url}/tenants/acme/")
    page.wait_for_function("() => document.getElementById('chart-requests').dataset.points > 0")
    assert int(page.locator("#chart-requests").get_attribute("data-points")) >= 2
    assert sorted(page.locator("#chart-requests .legendtext").all_text_contents()) == ["chat", "embed"]
    assert "38 requests" in page.locator("#usage-totals").inner_text()
    assert page.locator("#new-key-form").count() == 0


@pytest.mark.django_db
def test_viewers_cannot_write_through_the_console(client, redis_conn):
    tenant = Tenant.objects.create(name="acme")
    client.force_login(user_with_role("viewer", "watcher"))
    assert client.post("/tenants/", {"name": "other"}).status_code == 403
    assert client.post("/tenants/acme/", {"name": "ci", "priority": 0}).status_code == 403
    assert client.post("/tenants/acme/limits/", {"limits-rpm_limit": 1}).status_code == 403
    operator = user_with_role("operator", "ops")
    from tenants import services

    key, _ = services.key_create(tenant=tenant, name="ci", actor=operator)
    assert client.post(f"/tenants/acme/keys/{key.prefix}/revoke/").status_code == 403
    assert client.get(f"/tenants/acme/keys/{key.prefix}/revoke/").status_code == 405
    assert not Tenant.objects.filter(name="other").exists() and ApiKey.objects.get().revoked_at is None
    assert Tenant.objects.get(name="acme").rpm_limit is None
