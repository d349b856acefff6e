"""Mute and severity at a glance, in a real Chromium: a silenced firing alert is not a red live page
in the alert list and in the home page's "Firing now" (muted row, grey status, a
"silenced" badge linking to its silence with the end time as title); snoozed, acknowledged and
delivery-failing badges and page/ticket pills; an integration's alert names its integration as
its source. Receivers are one click from the alert list and the routing tree, and the route form's
"add one" makes a receiver and comes back to the form with it selected."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from alerts import services
from alerts.models import Alert, Delivery, Integration, Notification, Receiver, Route, Silence
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

RED = "rgb(254, 226, 226)"  # .state-failed: a live page
GREY = "rgb(229, 231, 235)"  # .state-muted


def user(name: str, role: str) -> User:
    made = User.objects.create_user(name, password=f"pw-{name}-123456")
    made.groups.add(Group.objects.get(name=role))
    return made


def fire(alertname: str, severity: str = "page", **fields) -> Alert:
    return services.alert_raise(labels={"alertname": alertname, "severity": severity},
                                annotations={"summary": f"{alertname} summary"}, severity=severity,
                                now=timezone.now(), **fields)


@pytest.fixture
def alerts(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    admin = user("root", "admin")
    user("viewer", "viewer")
    now = timezone.now()
    silence = Silence.objects.create(
        matchers=[{"name": "alertname", "value": "NodeDown", "isRegex": False, "isEqual": True}],
        starts_at=now - timedelta(minutes=5), ends_at=now + timedelta(hours=2), created_by="root",
        comment="kernel upgrade")
    made = {"silence": silence, "silenced": fire("NodeDown"), "live": fire("ErrorsBurning"),
            "snoozed": fire("DiskFull", "ticket"), "acked": fire("CpuHot"), "failing": fire("HookBroken"),
            "posted": fire("QueueStuck", "ticket", integration=Integration.objects.create(
                name="prod-am", token_prefix="abc", token_hash="h" * 64))}
    services.alert_snooze(alert=made["snoozed"], actor=admin, minutes=60)
    services.alert_acknowledge(alert=made["acked"], actor=admin)
    hook = Receiver.objects.create(name="broken-hook", url="http://127.0.0.1:9/hook")
    notification = Notification.objects.create(alert=made["failing"], receiver=hook, alert_status="firing",
                                               status="failed", attempts=1)
    Delivery.objects.create(notification=notification, attempt=1, outcome="permanent-error", http_status=404,
                            error="HTTP 404: no such hook")
    return made


def row(page, table: str, alert: Alert):
    return page.locator(f"{table} tr[data-alert='{alert.pk}']")


def test_badges_and_pills_in_the_alert_list_and_firing_now(live_server, page, page_errors, alerts):
    log_in(page, live_server.url, "root", "pw-root-123456")

    # "Firing now": the silenced page is muted and badged, the live one stays red.
    silenced = row(page, "#home-firing", alerts["silenced"])
    expect(silenced).to_have_class("alert-muted")
    badge = silenced.locator(".badge-silenced")
    expect(badge).to_have_text("silenced")
    expect(badge).to_have_attribute("title", f"silenced until {alerts['silence'].ends_at:%Y-%m-%d %H:%M} UTC by "
                                             f"silence {alerts['silence'].pk}: kernel upgrade")
    expect(silenced.locator(".sev-page")).not_to_have_css("background-color", RED)
    live = row(page, "#home-firing", alerts["live"])
    expect(live).not_to_have_class("alert-muted")
    expect(live.locator(".sev-page")).to_have_css("background-color", RED)
    expect(row(page, "#home-firing", alerts["snoozed"]).locator(".badge-snoozed")).to_contain_text("snoozed until")
    expect(page.locator("#firing-muted")).to_have_text("2 silenced or snoozed")
    expect(row(page, "#home-firing", alerts["posted"]).locator(".alert-source")).to_contain_text("prod-am")

    # The alert list: the same badges, plus acknowledged and delivery failing; page/ticket pills.
    page.goto(f"{live_server.url}/alerts/")
    silenced = row(page, "#alerts", alerts["silenced"])
    expect(silenced).to_have_class("alert-muted")
    expect(silenced.locator(".state")).to_have_css("background-color", GREY)
    expect(silenced.locator(".state")).to_have_text("firing (muted)")
    expect(row(page, "#alerts", alerts["live"]).locator(".state")).to_have_css("background-color", RED)
    expect(row(page, "#alerts", alerts["acked"]).locator(".badge-acked")).to_have_text("acked by root")
    failing = row(page, "#alerts", alerts["failing"]).locator(".badge-failing")
    expect(failing).to_have_text("delivery failing")
    expect(failing).to_have_attribute("title", "latest notification delivery: HTTP 404: no such hook")
    expect(row(page, "#alerts", alerts["snoozed"]).locator(".sev")).to_have_text("ticket")
    expect(row(page, "#alerts", alerts["live"]).locator(".sev")).to_have_text("page")
    for quiet in ("live", "posted"):
        expect(row(page, "#alerts", alerts[quiet]).locator(".badge")).to_have_count(0)

    # An integration's alert names it; an admin follows it to the integrations page.
    source = row(page, "#alerts", alerts["posted"]).locator(".alert-source a")
    expect(source).to_have_text("prod-am")
    source.click()
    page.wait_for_url(f"{live_server.url}/alerts/integrations/#integration-*")
    expect(page.locator("#integrations")).to_contain_text("prod-am")

    # The badge leads to the silence.
    page.goto(f"{live_server.url}/alerts/")
    row(page, "#alerts", alerts["silenced"]).locator(".badge-silenced").click()
    page.wait_for_url(f"{live_server.url}/alerts/silences/#silence-{alerts['silence'].pk}")
    expect(page.locator(f"#silences-active #silence-{alerts['silence'].pk}")).to_contain_text("kernel upgrade")
    assert not page_errors


def test_a_viewer_sees_the_source_unlinked_and_no_receivers_link(live_server, page, alerts):
    log_in(page, live_server.url, "viewer", "pw-viewer-123456")
    page.goto(f"{live_server.url}/alerts/")
    source = row(page, "#alerts", alerts["posted"]).locator(".alert-source")
    expect(source).to_contain_text("prod-am (integration)")
    expect(source.locator("a")).to_have_count(0)  # the integrations page is for admins
    expect(page.locator("#receivers-link")).to_have_count(0)
    expect(row(page, "#alerts", alerts["silenced"]).locator(".badge-silenced")).to_be_visible()


def test_receivers_are_findable_and_the_route_form_adds_one(live_server, page, page_errors, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user("root", "admin")
    log_in(page, live_server.url, "root", "pw-root-123456")
    page.goto(f"{live_server.url}/alerts/")
    page.click("#receivers-link")
    page.wait_for_url(f"{live_server.url}/alerts/receivers/")
    page.goto(f"{live_server.url}/alerts/routes/")
    expect(page.locator("#receivers-link")).to_have_attribute("href", "/alerts/receivers/")

    page.click("#route-new")
    page.wait_for_url(f"{live_server.url}/alerts/routes/new/")
    expect(page.locator("#receiver-add")).to_contain_text("No receiver exists yet")
    page.click("#receiver-add-link")
    page.wait_for_url(f"{live_server.url}/alerts/receivers/new/?next=/alerts/routes/new/")
    expect(page.locator("#receiver-next")).to_contain_text("Saving returns to")
    page.fill("#id_name", "team-hook")
    page.fill("#id_url", "http://127.0.0.1:9/hook")
    page.click("#receiver-save")

    # Back on the route form, the new receiver chosen.
    page.wait_for_url(f"{live_server.url}/alerts/routes/new/?receiver=team-hook")
    assert page.input_value("#id_receiver") == "team-hook"
    expect(page.locator("#receiver-add")).not_to_contain_text("No receiver exists yet")
    page.fill("#id_matchers", 'severity="page"')
    page.click("#route-save")
    page.wait_for_url(f"{live_server.url}/alerts/routes/")
    assert Route.objects.get(is_default=False).receiver.name == "team-hook"
    assert not page_errors
