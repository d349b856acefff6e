"""The cost report in a real Chromium: totals, the four plotly charts drawn from the ledger, a
tenant's drill-down, the CSV export link, and an operator editing the price book."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone

from costing.ledger import floor_hour, ledger_sync
from costing.models import Price
from tests.browser.conftest import log_in
from tests.costing.conftest import make_deployment, make_replica, price, usage

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def costed(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.INFEROPS_COST_LOCAL_CPUS = 4
    user = User.objects.create_user("ops", password="pw-ops-123456")
    user.groups.add(Group.objects.get(name="operator"))
    now = timezone.now()
    start = floor_hour(now) - timedelta(hours=3)
    for name in ("chat", "embed"):
        deployment = make_deployment(name, resources={"cpu": "2"})
        make_replica(deployment, started_at=start)
    price("cpu", "0.50", start - timedelta(days=1))
    usage("chat", "acme", start + timedelta(minutes=5), prompt=300, completion=300, requests=3)
    usage("chat", "beta", start + timedelta(minutes=6), prompt=100, completion=100)
    usage("embed", "acme", start + timedelta(hours=1, minutes=5), prompt=500, completion=0)
    ledger_sync(now)
    return start


def test_operator_reads_the_month_drills_into_a_tenant_and_edits_the_price_book(live_server, page, costed):
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    month = costed.strftime("%Y-%m")
    page.click("header nav >> text=Costs")
    page.goto(f"{live_server.url}/costs/?month={month}")
    assert page.input_value("#month") == month
    total = page.locator("#total-usd").inner_text()
    assert total.startswith("$") and float(total[1:]) > 0
    assert float(page.locator("#idle-usd").inner_text()[1:]) > 0  # hours without traffic
    for chart in ("chart-daily", "chart-tenants", "chart-mtok", "chart-idle"):
        page.wait_for_function(f"document.getElementById('{chart}').dataset.points > 0")
        assert page.locator(f"#{chart} .main-svg").count() > 0
    rows = page.locator("#by-tenant tbody tr")
    assert rows.count() == 3  # acme, beta, idle
    assert page.locator("#by-deployment tr[data-deployment='chat']").count() == 1
    page.click("#by-tenant >> text=acme")
    page.wait_for_selector("#drill")
    assert page.locator("#drill tr[data-deployment='chat']").count() == 1
    assert page.locator("#drill tr[data-deployment='embed']").count() == 1
    href = page.get_attribute("#export-csv", "href")
    assert href.endswith(f"?month={month}")
    response = page.request.get(f"{live_server.url}{href}")
    assert response.status == 200 and "acme,chat,1" in response.text()

    page.goto(f"{live_server.url}/costs/prices/")
    page.fill("#id_resource", "gpu:H100")
    page.fill("#id_usd_per_hour", "-1")
    page.fill("#id_effective_from", "2026-01-01T00:00")
    page.click("#price-form button[type=submit]")
    assert "greater than or equal to 0" in page.locator("#price-form").inner_text()
    assert not Price.objects.filter(resource="gpu:H100").exists()
    page.fill("#id_usd_per_hour", "2.49")
    page.click("#price-form button[type=submit]")
    page.wait_for_selector("#prices tr[data-resource='gpu:H100']")
    assert Price.objects.get(resource="gpu:H100").usd_per_hour == Decimal("2.49")
    assert errors == []
