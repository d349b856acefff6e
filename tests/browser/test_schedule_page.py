"""On-call schedules in a real Chromium: the home page says who is on call; an operator adds an
override on the schedule page (a bad one first: the message, nothing written), sees the person on
call change and the timeline draw the override, then removes it. A viewer sees no forms."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from alerts.models import ScheduleOverride
from alerts.schedules.services import schedule_save
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def schedule(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("ops", password="pw-ops-123456").groups.add(Group.objects.get(name="operator"))
    User.objects.create_user("watcher", password="pw-watcher-123456").groups.add(Group.objects.get(name="viewer"))
    for name in ("alice", "bob"):
        User.objects.create_user(name)
    # alice's week started a day ago: bob takes over in six days.
    weekly = {"name": "weekly", "rotation": "weekly", "starts_at": timezone.now() - timedelta(days=1), "ends_at": None,
              "users": ["alice", "bob"]}
    return schedule_save(instance=None, fields={"name": "primary", "time_zone": "Europe/Berlin", "description": ""},
                         layers=[weekly], actor=None)


def test_operator_overrides_who_is_on_call(live_server, page, page_errors, schedule):
    log_in(page, live_server.url, "ops", "pw-ops-123456")

    page.goto(f"{live_server.url}/")
    panel = page.locator("#on-call-panel")
    expect(panel.locator("#on-call-primary .now")).to_have_text("alice")
    expect(panel.locator("#on-call-primary .next")).to_contain_text("bob")
    expect(panel.locator("#firing-alerts")).to_contain_text("No alerts firing")
    panel.get_by_role("link", name="primary").click()
    page.wait_for_url(f"{live_server.url}/alerts/schedules/primary/")
    expect(page.locator("#on-call-now")).to_have_text("alice")
    expect(page.locator("#schedule-timeline .bars path").first).to_be_visible()
    expect(page.locator("#layers")).to_contain_text("alice")

    # Ends before it starts: the service's message under the form, nothing written.
    page.fill("#id_user", "bob")
    start = page.input_value("#id_starts")
    page.fill("#id_ends", start)
    page.click("#override-save")
    expect(page.locator("#override-form .error")).to_contain_text("ends_at must come after starts_at")
    assert not ScheduleOverride.objects.exists()

    page.fill("#id_user", "bob")
    ends = datetime.fromisoformat(page.input_value("#id_starts")) + timedelta(hours=8)
    page.fill("#id_ends", ends.strftime("%Y-%m-%dT%H:%M"))
    page.fill("#id_reason", "alice is at the dentist")
    page.click("#override-save")
    page.wait_for_url(f"{live_server.url}/alerts/schedules/primary/")
    expect(page.locator(".messages")).to_contain_text("bob is on call for primary")
    expect(page.locator("#on-call-now")).to_have_text("bob")
    expect(page.locator("#on-call-next")).to_contain_text("alice")
    override = ScheduleOverride.objects.get()
    assert override.user.username == "bob" and override.created_by.username == "ops"
    expect(page.locator(f"#override-{override.pk}")).to_contain_text("alice is at the dentist")
    assert page.locator("#schedule-timeline").get_attribute("data-shifts") == "4"  # bob (override), alice, bob, alice

    page.goto(f"{live_server.url}/")
    expect(page.locator("#on-call-primary .now")).to_have_text("bob")

    page.goto(f"{live_server.url}/alerts/schedules/primary/")
    page.locator(f"#override-{override.pk} button.remove").click()
    expect(page.locator(".messages")).to_contain_text("Override of bob removed")
    expect(page.locator("#on-call-now")).to_have_text("alice")
    assert not ScheduleOverride.objects.exists()
    assert not page_errors


def test_viewer_sees_the_schedule_without_forms(live_server, page, schedule):
    log_in(page, live_server.url, "watcher", "pw-watcher-123456")
    page.goto(f"{live_server.url}/alerts/")
    page.click("#schedules-link")
    page.wait_for_url(f"{live_server.url}/alerts/schedules/")
    expect(page.locator("#schedule-primary .now")).to_have_text("alice")
    page.click("#schedule-primary a")
    expect(page.locator("#on-call-now")).to_have_text("alice")
    assert page.locator("#override-form").count() == 0 and page.locator("#schedule-edit").count() == 0
    assert page.locator("button.remove").count() == 0
