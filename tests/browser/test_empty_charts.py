"""Charts without data say so, on every kind of chart page (templates/partials/plotly.html), in a real
Chromium: a new deployment (its creation marked on the time axis), a tenant without traffic and a
month without costs. Once data arrive, the note goes."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from inferops.audit import audit_record, snapshot
from tenants.services import tenant_create
from tests.browser.conftest import log_in
from tests.costing.conftest import make_deployment, usage

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

NOTE = "No data yet"


@pytest.fixture
def operator(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    return user


def chart_notes(page, chart_ids: list[str]) -> dict[str, list[str]]:
    """Each chart's annotations once it has been drawn (plotly's own SVG text)."""
    for chart in chart_ids:
        page.wait_for_function(f"() => document.getElementById('{chart}').dataset.empty !== undefined && "
                               f"document.querySelector('#{chart} .main-svg') !== null")
    return {chart: page.locator(f"#{chart} .annotation-text").all_text_contents() for chart in chart_ids}


def test_empty_charts_say_no_data_yet_until_data_arrive(live_server, page, page_errors, operator):
    deployment = make_deployment("fresh")
    audit_record(actor=operator, action="deployment.create", obj=deployment, after=snapshot(deployment))
    tenant_create(name="quiet", actor=operator)
    log_in(page, live_server.url, "ops", "pw-ops-123456")

    page.goto(f"{live_server.url}/deployments/fresh/")
    charts = page.locator(".charts .chart").evaluate_all("els => els.map(e => e.id)")
    assert len(charts) >= 4
    notes = chart_notes(page, charts)
    assert all(NOTE in texts for texts in notes.values()), notes
    # The creation stays marked on the time axis; the empty value axis is hidden.
    errors_chart = page.locator("#chart-error_rate")
    assert errors_chart.get_attribute("data-events") == "1"
    assert errors_chart.locator(".xtick").count() > 0 and errors_chart.locator(".ytick").count() == 0

    page.goto(f"{live_server.url}/tenants/quiet/")
    notes = chart_notes(page, ["chart-requests", "chart-tokens"])
    assert all(NOTE in texts for texts in notes.values()), notes

    month = timezone.now().strftime("%Y-%m")
    page.goto(f"{live_server.url}/costs/?month={month}")
    notes = chart_notes(page, ["chart-daily", "chart-tenants", "chart-mtok", "chart-idle"])
    assert all(NOTE in texts for texts in notes.values()), notes
    assert page.locator("#chart-daily .xtick").count() == 0  # no axes of nothing

    # Traffic arrives: the tenant's charts draw it, without the note.
    usage("fresh", "quiet", timezone.now().replace(second=0, microsecond=0), prompt=100, completion=20, requests=3)
    page.goto(f"{live_server.url}/tenants/quiet/")
    notes = chart_notes(page, ["chart-requests", "chart-tokens"])
    assert not any(NOTE in texts for texts in notes.values()), notes
    assert page.locator("#chart-requests").get_attribute("data-empty") == "false"
    assert page_errors == []
