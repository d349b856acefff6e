"""The routing console in a real Chromium: an operator creates an escalation policy, adds a route
`severity="page"` to it (first naming a receiver too: the service's message, nothing written),
reads it in the tree with its inherited grouping, edits its group_wait and deletes it."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Group, User
from playwright.sync_api import expect

from alerts.models import EscalationPolicy, Receiver, Route
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def operator(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("ops", password="pw-ops-123456").groups.add(Group.objects.get(name="operator"))
    Receiver.objects.create(name="pager", kind="pagerduty", url="http://127.0.0.1:9/pd", routing_key="k")
    Receiver.objects.create(name="team-slack", kind="slack", url="http://127.0.0.1:9/slack")


def test_operator_routes_pages_to_a_new_escalation_policy_edits_and_deletes_the_route(live_server, page, page_errors,
                                                                                     operator):
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/alerts/")

    # The policy first, from the alerts list.
    page.click("#policies-link")
    page.wait_for_url(f"{live_server.url}/alerts/escalation-policies/")
    page.click("#policy-new")
    page.fill("#id_name", "db-oncall")
    page.fill("#id_step-0-after_minutes", "0")
    page.select_option("#id_step-0-receivers", ["pager"])
    page.fill("#id_step-1-after_minutes", "15")
    page.select_option("#id_step-1-receivers", ["pager", "team-slack"])
    page.click("#policy-save")
    page.wait_for_url(f"{live_server.url}/alerts/escalation-policies/")
    row = page.locator("#policy-db-oncall")
    expect(row.locator(".steps")).to_contain_text("after 0 min: notify receivers pager")
    expect(row.locator(".steps")).to_contain_text("after 15 min: notify receivers pager, team-slack")
    expect(row.locator(".routes")).to_contain_text("no route")

    # The route: naming both a receiver and the policy is refused beside the form, nothing written.
    page.goto(f"{live_server.url}/alerts/")
    page.click("#routes-link")
    page.wait_for_url(f"{live_server.url}/alerts/routes/")
    expect(page.locator("#routing-help")).to_contain_text("first child whose matchers all hold")
    page.click("#route-new")
    page.fill("#id_matchers", 'severity="page"')
    page.select_option("#id_receiver", "pager")
    page.select_option("#id_escalation_policy", "db-oncall")
    page.click("#route-save")
    expect(page.locator(".field-receiver .error")).to_contain_text("not both")
    assert page.input_value("#id_matchers") == 'severity="page"'
    assert not Route.objects.filter(is_default=False).exists()

    page.select_option("#id_receiver", "")
    page.click("#route-save")
    page.wait_for_url(f"{live_server.url}/alerts/routes/")
    expect(page.locator(".messages")).to_contain_text("saved")
    route = Route.objects.get(is_default=False)
    assert route.matchers == [{"name": "severity", "value": "page", "op": "="}]
    assert route.escalation_policy == EscalationPolicy.objects.get(name="db-oncall")
    row = page.locator(f"#route-{route.pk}")
    expect(row.locator(".matchers")).to_have_text('severity="page"')
    expect(row.locator(".target a")).to_have_text("escalation policy db-oncall")
    expect(row.locator(".timing-group_wait")).to_contain_text("(inherited)")
    # Under the default route, after it.
    assert page.locator("tr.route").first.get_attribute("id") != f"route-{route.pk}"
    assert row.get_attribute("data-depth") == "1"

    # Edit its group_wait: now its own.
    row.locator("a.edit").click()
    page.wait_for_url(re.compile(rf".*/alerts/routes/{route.pk}/edit/$"))
    assert page.input_value("#id_matchers") == 'severity="page"'
    page.fill("#id_group_wait_s", "45")
    page.click("#route-save")
    page.wait_for_url(f"{live_server.url}/alerts/routes/")
    wait = page.locator(f"#route-{route.pk} .timing-group_wait")
    expect(wait).to_contain_text("45 s")
    expect(wait).not_to_contain_text("inherited")
    route.refresh_from_db()
    assert route.group_wait_s == 45

    # The policy page names the route that uses it.
    page.goto(f"{live_server.url}/alerts/escalation-policies/")
    expect(page.locator("#policy-db-oncall .routes")).to_contain_text(f'route {route.pk}: severity="page"')

    page.goto(f"{live_server.url}/alerts/routes/")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator(f"#route-{route.pk} button.delete").click()
    expect(page.locator(".messages")).to_contain_text(f"Route {route.pk} deleted")
    expect(page.locator(f"#route-{route.pk}")).to_have_count(0)
    assert not Route.objects.filter(pk=route.pk).exists()
    assert not page_errors
