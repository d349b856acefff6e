"""The console on a phone (390 px wide, as on-call opens a link from a page): no page scrolls sideways,
the nav folds behind a Menu button, wide tables scroll inside themselves; and a 403 is a page in the
console's layout that names the role needed."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group
from playwright.sync_api import expect

from slo.models import Slo
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


PHONE_WIDTH = 390


def sideways_overflow(page) -> int:
    """How many CSS pixels the page is wider than the phone's screen (not than window.innerWidth: a
    mobile browser widens its layout viewport to fit content that overflows)."""
    return page.evaluate("() => document.documentElement.scrollWidth") - PHONE_WIDTH


def test_pages_fit_a_390px_phone(live_server, browser, burning_alert):
    alert = burning_alert
    slo = Slo.objects.get()
    context = browser.new_context(viewport={"width": PHONE_WIDTH, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        log_in(page, live_server.url, "oncall", "pw-oncall-123456")
        expect(page.locator("#main-nav")).to_be_hidden()
        page.click(".menu-toggle")
        expect(page.locator("#main-nav")).to_be_visible()
        assert page.locator(".menu-toggle").get_attribute("aria-expanded") == "true"
        page.click("#main-nav >> text=Alerts")
        page.wait_for_url(f"{live_server.url}/alerts/")

        deployment = alert.slo.deployment.name
        for path in ("/", "/alerts/", f"/alerts/{alert.pk}/", "/deployments/", f"/deployments/{deployment}/",
                     "/slos/", f"/slos/{slo.pk}/", "/models/", "/tenants/", "/alerts/silences/"):
            page.goto(f"{live_server.url}{path}")
            page.wait_for_load_state("load")
            assert sideways_overflow(page) <= 0, f"{path} scrolls sideways on a 390 px screen"
        # The alert page's facts and actions are on screen, not off to the side.
        page.goto(f"{live_server.url}/alerts/{alert.pk}/")
        for selector in ("#alert-status", "#alert-ack"):
            box = page.locator(selector).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= PHONE_WIDTH, selector
    finally:
        context.close()


def test_403_is_a_console_page_naming_the_role(live_server, page, burning_alert):
    log_in(page, live_server.url, "oncall", "pw-oncall-123456")
    response = page.goto(f"{live_server.url}/audit/")
    assert response.status == 403
    expect(page.locator("#forbidden")).to_contain_text("The audit log needs the admin role.")
    expect(page.locator("#forbidden")).to_contain_text("with the operator role")
    expect(page.locator("#main-nav")).to_be_visible()

    page.context.clear_cookies()
    nobody = Group.objects.get(name="operator").user_set.get()
    nobody.groups.clear()
    log_in(page, live_server.url, "oncall", "pw-oncall-123456")
    page.goto(f"{live_server.url}/users/")  # no console page without a role (issue 40), this one neither
    expect(page.locator("#forbidden")).to_contain_text("Your account has no role yet")
    expect(page.locator("#forbidden")).to_contain_text("with no role yet")
