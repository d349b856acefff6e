"""Silences in a real Chromium: an operator fills the form (a bad regex first: the API's message,
nothing written), sees the silence active and matching the firing alert, and expires it."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from alerts import services
from alerts.models import AlertEvent, Silence
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def firing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("ops", password="pw-ops-123456").groups.add(Group.objects.get(name="operator"))
    now = timezone.now()
    node_down = services.alert_raise(labels={"alertname": "NodeDown", "instance": "node-1:9100", "severity": "page"},
                                     annotations={"summary": "node-1 is down"}, severity="page", now=now)
    other = services.alert_raise(labels={"alertname": "DiskFull", "instance": "node-2:9100", "severity": "ticket"},
                                 annotations={"summary": "disk"}, severity="ticket", now=now)
    return node_down, other


def test_operator_creates_a_silence_sees_what_it_matches_and_expires_it(live_server, page, page_errors, firing):
    node_down, other = firing
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/alerts/silences/")
    expect(page.locator("#silences-active")).to_contain_text("No active silences")
    page.click("#silence-new")
    page.wait_for_url(f"{live_server.url}/alerts/silences/new/")

    # A regex that does not compile: its line named under the matchers, nothing written.
    page.fill("#id_matchers", "alertname=NodeDown\ninstance=~node-1(")
    page.fill("#id_ends", "2h")
    page.fill("#id_comment", "kernel upgrade")
    page.click("#silence-save")
    expect(page.locator(".field-matchers .error")).to_contain_text(
        "Line 2: instance=~node-1(: 'node-1(' is not a valid regular expression for =~")
    assert page.input_value("#id_matchers") == "alertname=NodeDown\ninstance=~node-1("
    assert not Silence.objects.exists()

    page.fill("#id_matchers", 'alertname=NodeDown\ninstance=~"node-1.*"\nseverity!=ticket')
    page.click("#silence-save")
    page.wait_for_url(f"{live_server.url}/alerts/silences/")
    expect(page.locator(".messages")).to_contain_text("Silence")
    silence = Silence.objects.get()
    assert silence.created_by == "ops" and silence.matchers == [
        {"name": "alertname", "value": "NodeDown", "isRegex": False, "isEqual": True},
        {"name": "instance", "value": "node-1.*", "isRegex": True, "isEqual": True},
        {"name": "severity", "value": "ticket", "isRegex": False, "isEqual": False}]
    row = page.locator(f"#silences-active #silence-{silence.pk}")
    expect(row).to_contain_text('instance=~"node-1.*"')
    expect(row).to_contain_text("kernel upgrade")
    expect(row.locator(".matching")).to_contain_text(f"NodeDown #{node_down.pk}")
    expect(row.locator(".matching")).not_to_contain_text(f"#{other.pk}")

    row.locator("button.expire").click()
    expect(page.locator(".messages")).to_contain_text(f"Silence {silence.pk} expired")
    expect(page.locator(f"#silences-expired #silence-{silence.pk}")).to_be_visible()
    expect(page.locator("#silences-active")).to_contain_text("No active silences")
    silence.refresh_from_db()
    assert silence.ends_at <= timezone.now()
    assert not AlertEvent.objects.filter(kind="muted").exists()  # raised before the silence: they notified
    assert not page_errors
