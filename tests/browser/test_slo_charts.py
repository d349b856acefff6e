"""The SLO page's charts against its header, in a real Chromium: an SLO made an hour ago with a
few sparse events draws its budget from its creation (not 30 days of 100 %) down to the very
figure the header shows, keeps the SLI on the SLI chart's axis, and names windows as `1d & 2h`;
too few events read "insufficient traffic" with the count so far, on the page and the list."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from slo.budget import floor_minute
from slo.evaluation import evaluate_slos
from slo.models import Slo
from slo.services import slo_create
from tests.browser.conftest import log_in
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHARTS_DRAWN = ("() => ['chart-budget', 'chart-burn', 'chart-sli']"
                ".every(id => document.getElementById(id).dataset.points > 0)")


def chart(page, element_id: str) -> dict:
    """What plotly drew: the first trace and the axes it settled on."""
    return page.evaluate("""id => {
        const el = document.getElementById(id);
        return {x: el.data[0].x, y: el.data[0].y, mode: el.data[0].mode,
                xrange: el._fullLayout.xaxis.range.map(t => Date.parse(t)), yrange: el._fullLayout.yaxis.range,
                notes: (el.layout.annotations || []).map(a => a.text)};
    }""", element_id)


@pytest.fixture
def sparse_slo():
    user = User.objects.create_user("charts-ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    deployment = make_deployment("chat", "tiny")
    now = timezone.now()
    slo = slo_create(actor=user, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=500.0,
                     objective=0.99, window="30d", min_requests=50)
    # Made an hour ago (before its first evaluation, so that is where its data begin).
    created = now - timedelta(hours=1)
    Slo.objects.filter(pk=slo.pk).update(created_at=created)
    # Seven requests in the hour, two of them slow: a spent budget, but too few events to judge.
    rows = [event(now - timedelta(minutes=minutes), ttft_ms=100.0) for minutes in (50, 41, 33, 20, 9)]
    rows += [event(now - timedelta(minutes=minutes), ttft_ms=2000.0) for minutes in (25, 2)]
    insert_events(rows)
    evaluate_slos(now=timezone.now())
    slo.refresh_from_db()
    return slo, floor_minute(created)


def test_budget_chart_starts_at_creation_and_ends_at_the_header_figure(live_server, page, sparse_slo):
    slo, created = sparse_slo
    status = slo.status
    assert status.state == "insufficient" and status.total == 7 and status.budget_remaining < 0
    log_in(page, live_server.url, "charts-ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/slos/{slo.pk}/")
    page.wait_for_function(CHARTS_DRAWN, timeout=30000)

    # The header: the budget as the evaluation computed it (overspent reads negative), and why it
    # is not "exhausted".
    header = page.locator("#budget-figure").inner_text()
    assert header == f"{status.budget_remaining * 100:.1f}%" and header.startswith("-")
    assert page.locator("#state").inner_text() == "insufficient traffic"
    assert page.locator("#traffic").inner_text().startswith("7 of 50 events")
    assert page.locator("#exhaustion").inner_text() == "not judged: insufficient traffic"

    budget = chart(page, "chart-budget")
    # It starts at the SLO's creation, not 30 days back at 100 %, and ends on the header's figure.
    assert timezone.datetime.fromisoformat(budget["x"][0].replace("Z", "+00:00")) == created
    assert budget["y"][0] == 100
    assert f"{budget['y'][-1]:.1f}%" == header
    assert budget["yrange"][0] <= budget["y"][-1]  # the negative end is on the axis
    assert "markers" in budget["mode"]  # sparse: points drawn, not only lines

    sli = chart(page, "chart-sli")
    known = [v for v in sli["y"] if v is not None]
    low, high = sli["yrange"]
    assert known and all(low <= v <= high for v in known + [slo.objective])
    assert "markers" in sli["mode"]

    # Windows read as durations, not minute counts, in the header and on the burn chart.
    rules = page.locator("#rules").inner_text()
    assert "ticket 3× over 1d & 2h" in rules and "page 14.4× over 1h & 5m" in rules and "1440m" not in rules
    assert "ticket 3× (1d & 2h)" in chart(page, "chart-burn")["notes"]

    # The list says the same, with the count so far.
    page.goto(f"{live_server.url}/slos/")
    row = page.locator("#slos tbody tr[data-name=chat-ttft]")
    assert "insufficient traffic" in row.inner_text() and "7 of 50 events" in row.inner_text()


def test_one_minute_of_data_gets_a_readable_time_axis(live_server, page, sparse_slo):
    """A deployment with one minute of traffic: one bucket, drawn on a span of minutes."""
    solo = make_deployment("solo", "tiny")
    insert_events([event(timezone.now(), deployment="solo") for _ in range(3)])
    fresh = slo_create(actor=None, name="solo-availability", deployment=solo, sli_kind="availability",
                       objective=0.995, window="1d", min_requests=1)
    evaluate_slos(now=timezone.now())
    log_in(page, live_server.url, "charts-ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/slos/{fresh.pk}/")
    page.wait_for_function(CHARTS_DRAWN, timeout=30000)
    budget = chart(page, "chart-budget")
    assert len(budget["x"]) <= 2 and budget["y"][-1] == 100
    start, end = budget["xrange"]
    assert end - start >= 25 * 60 * 1000  # a readable span, not sub-millisecond ticks
    assert page.locator("#state").inner_text() == "ok"
