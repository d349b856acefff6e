"""The SLO console in a real Chromium: the list by remaining budget, an SLO's charts and alert
history, create and edit forms that refuse what the API refuses."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from slo.budget import floor_minute
from slo.evaluation import evaluate_slos
from slo.models import Slo
from slo.services import slo_create

# The browser fixtures live beside the other browser suites.
from tests.browser.conftest import browser, log_in, page  # noqa: F401
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def burning_slos():
    """Two hours of traffic on `chat`, the last three minutes half failing; two SLOs made after it."""
    user = User.objects.create_user("slo-ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    deployment = make_deployment("chat", "tiny")
    now = timezone.now()
    rows = []
    for minutes_ago in range(120, 3, -1):
        rows += [event(floor_minute(now) - timedelta(minutes=minutes_ago), ttft_ms=200.0) for _ in range(10)]
    for minutes_ago in (3, 2, 1, 0):
        start = floor_minute(now) - timedelta(minutes=minutes_ago)
        rows += [event(start, ttft_ms=200.0) for _ in range(15)]
        rows += [event(start, status=503, error_kind="upstream_error", ttft_ms=None) for _ in range(15)]
    insert_events(rows)
    availability = slo_create(actor=user, name="chat-availability", deployment=deployment, sli_kind="availability",
                              objective=0.99, window="1d", owner="team-serving")
    latency = slo_create(actor=user, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=500.0,
                         objective=0.95, window="1d")
    evaluate_slos(now=timezone.now())
    return user, availability, latency


def test_operator_reads_the_budgets_and_manages_slos(live_server, page, burning_slos, tmp_path):  # noqa: F811
    user, availability, latency = burning_slos
    log_in(page, live_server.url, "slo-ops", "pw-ops-123456")
    page.click("header nav >> text=SLOs")
    page.wait_for_url(f"{live_server.url}/slos/")

    # The burnt SLO first, in the colour of its state; both say they were back-filled.
    rows = page.locator("#slos tbody tr")
    assert rows.nth(0).get_attribute("data-name") == "chat-availability"
    assert rows.nth(1).get_attribute("data-name") == "chat-ttft"
    availability.refresh_from_db()
    burnt_state = availability.status.state
    assert burnt_state in ("warning", "exhausted")
    assert rows.nth(0).get_attribute("data-state") == burnt_state
    assert rows.nth(0).locator(f".state.slo-{burnt_state}").count() == 1
    assert rows.nth(1).get_attribute("data-state") == "ok"
    assert "back-filled from" in rows.nth(0).inner_text()
    assert "page" in rows.nth(0).inner_text()  # the firing alert

    page.screenshot(path=str(tmp_path / "slo-list.png"), full_page=True)
    page.click("#slos >> text=chat-availability")
    page.wait_for_url(f"{live_server.url}/slos/{availability.pk}/")
    assert "Back-filled" in page.locator("#backfill").inner_text()
    page.wait_for_function(
        "() => ['chart-budget', 'chart-burn', 'chart-sli'].every(id => document.getElementById(id).dataset.points > 0)",
        timeout=30000)
    assert page.locator("#chart-burn").get_attribute("data-thresholds") == "4"
    assert "page 14.4×" in page.locator("#chart-burn").inner_text()
    page.evaluate("document.getElementById('chart-burn').dataset.points = 0")
    page.select_option("#burn-range", "3600")
    page.wait_for_function("() => document.getElementById('chart-burn').dataset.points > 0")
    # One point per minute of the last hour (the API includes both ends).
    assert 60 <= int(page.locator("#chart-burn").get_attribute("data-points")) <= 62
    history = page.locator("#alerts tbody").inner_text()
    assert "page" in history and "firing" in history
    page.screenshot(path=str(tmp_path / "slo-detail.png"), full_page=True)

    # Create: a latency SLO without a threshold is refused on the threshold field, as by the API.
    page.goto(f"{live_server.url}/slos/")
    page.click("text=New SLO")
    page.fill("#id_name", "chat-e2e")
    page.select_option("#id_deployment", "chat")
    page.select_option("#id_sli_kind", "latency")
    page.fill("#id_objective", "0.99")
    page.click("main form button[type=submit]")
    assert "at least one of" in page.locator("[data-field=ttft_ms] .error").inner_text()
    page.screenshot(path=str(tmp_path / "slo-form.png"), full_page=True)
    assert not Slo.objects.filter(name="chat-e2e").exists()
    page.fill("#id_e2e_ms", "4000")
    page.click("main form button[type=submit]")
    created = Slo.objects.get(name="chat-e2e")
    page.wait_for_url(f"{live_server.url}/slos/{created.pk}/")
    assert created.e2e_ms == 4000 and created.ttft_ms is None and created.created_by == user

    # Edit: an objective of 1.5 is refused on its field; 0.98 is saved.
    page.click("text=Edit")
    page.fill("#id_objective", "1.5")
    page.click("main form button[type=submit]")
    assert "strictly between 0 and 1" in page.locator("[data-field=objective] .error").inner_text()
    page.fill("#id_objective", "0.98")
    page.click("main form button[type=submit]")
    page.wait_for_url(f"{live_server.url}/slos/{created.pk}/")
    created.refresh_from_db()
    assert created.objective == 0.98


def test_viewer_cannot_open_the_forms(live_server, page, burning_slos):  # noqa: F811
    User.objects.create_user("slo-viewer", password="pw-viewer-123456").groups.add(Group.objects.get(name="viewer"))
    log_in(page, live_server.url, "slo-viewer", "pw-viewer-123456")
    page.goto(f"{live_server.url}/slos/")
    assert page.locator("text=New SLO").count() == 0
    response = page.goto(f"{live_server.url}/slos/new/")
    assert response.status == 403
