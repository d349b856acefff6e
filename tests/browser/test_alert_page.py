"""The alert page in a real Chromium: an on-call operator opens a burn-rate alert from the list,
reads the SLO's burn chart, acknowledges with one click, comments, snoozes, forces a degradation
level from the page, and resolves; the timeline shows each step and who took it."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from degradation.models import DegradationState
from tests.browser.conftest import log_in

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def timeline_text(page) -> str:
    return page.locator("#timeline").inner_text()


def test_on_call_acts_on_an_alert_from_its_page(live_server, page, page_errors, burning_alert):
    alert = burning_alert
    log_in(page, live_server.url, "oncall", "pw-oncall-123456")
    page.goto(f"{live_server.url}/alerts/")
    page.click(f'#alerts a[href="/alerts/{alert.pk}/"] >> nth=0')
    page.wait_for_url(f"{live_server.url}/alerts/{alert.pk}/")

    expect(page.locator("#alert-status")).to_have_text("firing")
    assert page.locator("#runbook").get_attribute("href") == "https://runbooks.example/ttft"
    assert "the platform" in page.locator("#alert-source").inner_text()
    page.wait_for_selector("#slo-burn-chart.js-plotly-plot")
    assert int(page.locator("#slo-burn-chart").get_attribute("data-points")) >= 120
    assert page.locator("#slo-budget-now").inner_text() == "-4900%"
    expect(page.locator("#alert-degradation-level")).to_contain_text("level")

    page.click("#alert-ack")
    expect(page.locator("#alert-status")).to_have_text("acknowledged")
    expect(page.locator(".messages")).to_contain_text(f"Alert {alert.pk} acknowledged")
    expect(page.locator("#alert-ack")).to_have_count(0)

    page.fill("#alert-comment-text", "TTFT regression after the 14:00 deploy; looking")
    page.click("#alert-comment")
    expect(page.locator(".messages")).to_contain_text("Comment added.")
    text = timeline_text(page)
    assert "Acknowledged\toncall" in text and "TTFT regression after the 14:00 deploy; looking" in text

    page.click("#alert-snooze-15")
    expect(page.locator("#alert-snoozed")).to_contain_text("snoozed until")
    assert "snoozed until" in page.locator("#alert-muted").inner_text()

    # A remedy: hold the deployment at level 2 for an hour, from the alert page, and come back to it.
    page.select_option("#id_override-level", "2")
    page.fill("#id_override-until", "1h")
    page.fill("#id_override-reason", "shed load while we roll back")
    page.click("#alert-degradation-force")
    page.wait_for_url(f"{live_server.url}/alerts/{alert.pk}/")
    expect(page.locator("#alert-degradation-level")).to_have_text("level 2 · short-answers")
    assert "shed load while we roll back" in page.locator("#alert-degradation-override").inner_text()
    assert DegradationState.objects.get().override_level == 2

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#alert-resolve")
    expect(page.locator("#alert-status")).to_have_text("resolved")
    expect(page.locator("#alert-closed")).to_be_visible()
    for button in ("#alert-ack", "#alert-resolve", "#alert-snooze-15"):
        expect(page.locator(button)).to_have_count(0)
    kinds = page.locator("#timeline tbody tr").evaluate_all("rows => rows.map(r => r.dataset.kind)")
    assert kinds == ["opened", "acknowledged", "comment", "snoozed", "resolved"]
    assert "Resolved\toncall" in timeline_text(page)
    alert.refresh_from_db()
    assert alert.status == "resolved" and alert.resolved_by.username == "oncall"
    assert page_errors == []
