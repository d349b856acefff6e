"""The degradation console in a real Chromium: an operator creates a policy on the deployment page
(a bad one first), forces level 1 with a reason, reads the badge, timeline and chart, and clears it."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from playwright.sync_api import expect

from degradation.models import DegradationPolicy, DegradationState
from slo.evaluation import evaluate_slos
from slo.services import slo_create
from tests.browser.conftest import log_in
from tests.degradation.conftest import LEVELS
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def burning_deployment(settings):
    """A deployment whose TTFT SLO burns at 50x in the current minute, with no policy yet."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    deployment = make_deployment()
    slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
               objective=0.99, window="1d", min_requests=10)
    now = timezone.now()
    insert_events([event(now, ttft_ms=100.0) for _ in range(20)] + [event(now, ttft_ms=400.0) for _ in range(20)])
    evaluate_slos(now=now)  # folds the events into the SLO's minute rows, which the chart reads
    return deployment


def test_operator_creates_a_policy_forces_a_level_and_clears_it(live_server, page, page_errors, burning_deployment):
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/deployments/chat/")
    assert "No degradation policy" in page.locator("#degradation-none").inner_text()

    # Levels that are not JSON, a window in hours and a negative hold: all three named after one submit.
    page.click("#degradation-policy summary")
    page.check("#degradation-policy-form >> text=chat-ttft")
    page.fill("#id_policy-levels", "[{oops")
    page.fill("#id_policy-window", "2h")
    page.fill("#id_policy-hold_s", "-5")
    page.click("#degradation-policy-save")
    form = page.locator("#degradation-policy-form")
    expect(form.locator(".field-levels .error")).to_contain_text("Not valid JSON")
    expect(form.locator(".field-window .error")).to_contain_text("Give whole minutes from 1m to 1h")
    expect(form.locator(".field-hold_s .error")).to_have_text("Ensure this value is greater than or equal to 0.")
    assert not DegradationPolicy.objects.exists()
    page.fill("#id_policy-window", "5m")
    page.fill("#id_policy-hold_s", "60")

    # A bad policy: the serializer's message under the levels box, the box keeping what was typed.
    bad = json.dumps([{**LEVELS[0], "exit_burn_rate": 9}])
    page.fill("#id_policy-levels", bad)
    page.click("#degradation-policy-save")
    error = page.locator("#degradation-policy-form .field-levels .error").inner_text()
    assert "levels[0].exit_burn_rate: The exit rate (9) must not be above the entry rate (5)" in error
    assert json.loads(page.input_value("#id_policy-levels")) == json.loads(bad)
    assert not DegradationPolicy.objects.exists()

    page.fill("#id_policy-levels", json.dumps(LEVELS))
    page.fill("#id_policy-hold_s", "30")
    page.click("#degradation-policy-save")
    page.wait_for_url(f"{live_server.url}/deployments/chat/#degradation")
    expect(page.locator(".messages")).to_contain_text("Degradation policy of chat saved")
    expect(page.locator("#degradation-level")).to_have_text("level 0 · normal")
    assert DegradationPolicy.objects.get().hold_s == 30

    # The chart: the burn of the current minute behind the level line, over the policy's quarter hour
    # (not six hours), the level and burn axes titled and their zeros at one height.
    page.wait_for_selector("#degradation-chart.js-plotly-plot")
    assert int(page.locator("#degradation-chart").get_attribute("data-points")) > 2
    layout = page.evaluate("""() => { const l = document.getElementById("degradation-chart")._fullLayout;
        const zero = a => -a.range[0] / (a.range[1] - a.range[0]);
        return {span: new Date(l.xaxis.range[1]) - new Date(l.xaxis.range[0]), zeros: [zero(l.yaxis), zero(l.yaxis2)],
                titles: [l.yaxis.title.text, l.yaxis2.title.text], ticks: l.yaxis2.tickvals}; }""")
    assert layout["span"] == 15 * 60 * 1000
    assert layout["zeros"][0] == pytest.approx(layout["zeros"][1])
    assert layout["titles"] == ["burn rate (× budget rate)", "level"]
    assert layout["ticks"] == [0, 1, 2]

    page.select_option("#id_override-level", "1")
    page.fill("#id_override-until", "30m")
    page.fill("#id_override-reason", "game day drill")
    page.click("#degradation-override-save")
    # The page's address does not change (#degradation before and after): wait for the new badge.
    expect(page.locator("#degradation-level")).to_have_text("level 1 · shed-batch")
    assert "game day drill" in page.locator("#degradation-override").inner_text()
    assert "below priority 5 get 503 degraded" in page.locator("#degradation-actions").inner_text()
    latest = page.locator("#degradation-timeline tbody tr").first.inner_text()
    assert "0 normal → 1 shed-batch" in latest and "game day drill" in latest and "ops" in latest
    page.wait_for_selector("#degradation-chart.js-plotly-plot")

    page.once("dialog", lambda dialog: dialog.accept())
    page.fill("#degradation-clear-form input[name=reason]", "drill over")
    page.click("#degradation-clear")
    expect(page.locator(".messages")).to_contain_text("Override of chat cleared")
    expect(page.locator("#degradation-override")).to_have_count(0)
    assert DegradationState.objects.get().override_until is None
    assert page_errors == []
