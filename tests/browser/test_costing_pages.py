"""The cost report in a real Chromium: totals, the four plotly charts drawn from the ledger, a
tenant's drill-down, the CSV export link, and an operator editing the price book; a single day on
date axes with thousands separators, the PDF finance reads, and the price book's warnings."""

from __future__ import annotations

import io
import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Group, User
from django.utils import timezone
from pypdf import PdfReader

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


def test_operator_reads_the_month_drills_into_a_tenant_and_edits_the_price_book(live_server, page, page_errors, costed):
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    month = costed.strftime("%Y-%m")
    page.click("header nav >> text=Costs")
    page.goto(f"{live_server.url}/costs/?month={month}")
    assert page.input_value("#month") == month
    total = page.locator("#total-usd").inner_text()
    assert total.startswith("$") and float(total[1:].replace(",", "")) > 0
    assert float(page.locator("#idle-usd").inner_text()[1:].replace(",", "")) > 0  # hours without traffic
    for chart in ("chart-daily", "chart-tenants", "chart-mtok", "chart-idle"):
        page.wait_for_function(f"() => document.getElementById('{chart}').dataset.points > 0")
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
    assert page_errors == []


@pytest.fixture
def expensive_hour(settings):
    """One busy hour of an 8-core replica at $150 a core-hour: $1,200.00, and 12,345 prompt tokens."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    User.objects.create_user("finance", password="pw-fin-123456").groups.add(Group.objects.get(name="viewer"))
    start = floor_hour(timezone.now()) - timedelta(hours=2)
    make_replica(make_deployment("chat", resources={"cpu": "8"}), started_at=start)
    price("cpu", "150", start - timedelta(days=1))  # entered now: back-dated
    usage("chat", "acme", start + timedelta(minutes=5), prompt=12_345, completion=6_789)
    ledger_sync(timezone.now())
    return start


CHARTS_ON_DAYS = ("chart-daily", "chart-mtok", "chart-idle")


def test_a_single_day_reads_as_dates_with_thousands_separators_and_its_pdf_as_finance_needs(
        live_server, page, page_errors, expensive_hour):
    log_in(page, live_server.url, "finance", "pw-fin-123456")
    hour = expensive_hour.strftime("%Y-%m-%dT%H:%M:%SZ")
    end = (expensive_hour + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    page.goto(f"{live_server.url}/costs/?start={hour}&end={end}")
    day = expensive_hour.strftime("%Y-%m-%d")
    for chart in CHARTS_ON_DAYS:
        page.wait_for_function(f"() => document.getElementById('{chart}').dataset.points > 0")
        labels = page.eval_on_selector_all(f"#{chart} .xtick text", "nodes => nodes.map(n => n.textContent)")
        assert labels == [day], (chart, labels)  # not 23:59:59.9996
        assert page.evaluate(f"document.getElementById('{chart}')._fullLayout.xaxis.type") == "date"
    assert page.inner_text("#total-usd") == "$1,200.00"
    assert page.inner_text("#tokens") == "12,345 / 6,789"
    acme = page.locator("#by-tenant tr[data-tenant='acme'] td")
    assert acme.nth(1).inner_text() == "$1,200.00" and acme.nth(2).inner_text() == "12,345"
    assert "Back-dated price: cpu (on-demand) at $150.00 per core-hour" in page.inner_text("#notes")
    assert "prompt tokens x 1" in page.inner_text("#allocation")

    href = page.get_attribute("#export-pdf", "href")
    response = page.request.get(f"{live_server.url}{href}")
    assert response.status == 200 and response.headers["content-type"] == "application/pdf"
    pages = [p.extract_text() for p in PdfReader(io.BytesIO(response.body())).pages]
    text = " ".join(" ".join(pages).split())
    assert "Amounts in USD ($)" in text and "Total cost (USD)" in text
    assert re.search(r"Generated \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC", text)
    assert "1,200.00" in text and "12,345" in text
    price_from = (expensive_hour - timedelta(days=1)).strftime("%Y-%m-%d %H:%M")
    assert f"cpu (on-demand) core-hour 150.00 {price_from} UTC open" in text
    assert "Allocation method" in text and "in proportion to their weighted tokens" in text
    assert "Back-dated price" in text
    assert f"Page 1 of {len(pages)}" in pages[0]
    assert page_errors == []


def test_the_price_book_warns_of_a_back_dated_price_and_of_one_nothing_holds(live_server, page, costed):
    log_in(page, live_server.url, "ops", "pw-ops-123456")
    page.goto(f"{live_server.url}/costs/prices/")
    last_month = timezone.now().replace(day=1) - timedelta(days=3)
    page.fill("#id_resource", "gpu:A100")
    page.fill("#id_usd_per_hour", "1.80")
    page.fill("#id_effective_from", last_month.strftime("%Y-%m-%dT00:00"))
    page.click("#price-form button[type=submit]")
    row = page.locator("#prices tr[data-resource='gpu:A100']")
    row.wait_for()
    warnings = row.locator(".price-warning").all_inner_texts()
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(f"⚠ Back-dated into {last_month:%Y-%m}, a month that had ended")
    assert warnings[1].startswith("⚠ No replica holds gpu:A100")
    body = page.inner_text("body")
    assert f"gpu:A100: Back-dated into {last_month:%Y-%m}" in body  # the message after adding it
    assert "gpu:A100: No replica holds gpu:A100" in body
    assert page.locator("#prices tr[data-resource='cpu'] .price-warning").count() == 0  # held, on time
    assert Price.objects.filter(resource="gpu:A100").exists()  # warned, not refused
