"""Offline batches in costing: their tokens apart in the hourly usage, their share of the cost, revenue at
the batch price (the list price less its discount) in the report, its CSV, PDF and console page, and
batch_price() for the batches console."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from pypdf import PdfReader

from costing import services
from costing.ledger import ledger_sync
from costing.models import Adjustment, UsageHour
from costing.report import Cell, report_csv, report_in_cents
from tenants.models import Tenant
from tests.costing.conftest import at, make_deployment, make_replica, price, usage

pytestmark = pytest.mark.django_db
MONTH = {"month": "2026-03"}


def list_price(deployment: str, prompt: str, completion: str, start: datetime, tenant: str = "", **fields):
    return services.list_price_create(deployment=deployment, tenant=tenant, usd_per_mtok_prompt=Decimal(prompt),
                                      usd_per_mtok_completion=Decimal(completion), effective_from=start, actor=None,
                                      **fields)


@pytest.fixture
def chat():
    """`chat`, one core at $0.60/h from 10:00: hour 10 costs $0.60. Weighted tokens (prompt x 1 +
    completion x 4) in hour 10: acme 500k interactive + 300k batch, beta 200k batch, 1M in all."""
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0))
    usage("chat", "acme", at(0, 5), prompt=100_000, completion=100_000)
    usage("chat", "acme", at(0, 6), prompt=300_000, completion=0, batch_id="batch_a", ttft_ms=60_000.0)
    usage("chat", "beta", at(0, 7), prompt=0, completion=50_000, batch_id="batch_b")
    ledger_sync(at(1))
    return deployment


def test_the_hourly_usage_keeps_batch_tokens_apart(chat):
    rows = {row.tenant: row for row in UsageHour.objects.all()}
    assert (rows["acme"].prompt_tokens, rows["acme"].batch_prompt_tokens, rows["acme"].batch_completion_tokens) == (
        400_000, 300_000, 0)
    assert (rows["beta"].completion_tokens, rows["beta"].batch_completion_tokens) == (50_000, 50_000)


def test_the_report_gives_batch_tokens_their_cost_share_and_revenue_at_the_discount(chat, api):
    list_price("chat", "1", "4", at(-24))  # batches pay the default 50 % less
    list_price("chat", "2", "8", at(-24), tenant="beta", batch_discount_percent=Decimal(25))
    body = api("viewer").get("/api/v1/costing/report/", MONTH).json()
    tenants = {row["tenant"]: row for row in body["by_tenant"]}
    acme, beta = tenants["acme"], tenants["beta"]
    assert (acme["usd"], acme["batch_tokens"], acme["batch_usd"]) == ("0.4800", 300_000, "0.1800")
    # 0.1M x $1 + 0.1M x $4 interactive, 0.3M x $1 x 50 % for the batch.
    assert (acme["revenue_usd"], acme["batch_revenue_usd"]) == ("0.6500", "0.1500")
    # Its own price: 0.05M x $8 x 75 %.
    assert (beta["usd"], beta["batch_tokens"], beta["batch_usd"], beta["batch_revenue_usd"]) == (
        "0.1200", 50_000, "0.1200", "0.3000")
    assert acme["deployments"][0]["batch_usd"] == "0.1800" and acme["deployments"][0]["batch_tokens"] == 300_000
    assert (body["batch_tokens"], body["batch_usd"], body["batch_revenue_usd"]) == (350_000, "0.3000", "0.4500")
    assert body["revenue_usd"] == "0.9500"
    [chat_row] = body["by_deployment"]
    [version_row] = body["by_version"]
    assert chat_row["batch_usd"] == version_row["batch_usd"] == "0.3000"
    assert chat_row["batch_tokens"] == version_row["batch_tokens"] == 350_000


def test_without_list_prices_batch_revenue_is_null(chat, api):
    body = api("viewer").get("/api/v1/costing/report/", MONTH).json()
    assert body["batch_usd"] == "0.3000" and body["batch_revenue_usd"] is None
    assert all(row["batch_revenue_usd"] is None for row in body["by_tenant"])


def test_csv_pdf_and_console_show_the_batch_column(chat, api, client, make_user):
    list_price("chat", "1", "4", at(-24))
    viewer = api("viewer")
    rows = list(csv.DictReader(io.StringIO(viewer.get("/api/v1/costing/report/", {**MONTH, "format": "csv"})
                                           .content.decode())))
    by_tenant = {row["tenant"]: row for row in rows}
    assert (by_tenant["acme"]["batch_tokens"], by_tenant["acme"]["batch_usd"],
            by_tenant["acme"]["batch_revenue_usd"]) == ("300000", "0.1800", "0.1500")
    assert (by_tenant["TOTAL"]["batch_tokens"], by_tenant["TOTAL"]["batch_usd"]) == ("350000", "0.3000")
    assert by_tenant["(idle)"]["batch_tokens"] == "0"

    pdf = viewer.get("/api/v1/costing/report/", {**MONTH, "format": "pdf"})
    text = " ".join(" ".join(page.extract_text() for page in PdfReader(io.BytesIO(pdf.content)).pages).split())
    assert "Batch tokens" in text and "Batch cost (USD)" in text
    assert "Offline batches: 350,000 tokens" in text

    client.force_login(make_user("viewer"))
    page = client.get("/costs/", MONTH).content.decode()
    assert "Batch tokens / cost" in page and "300,000 / $0.18" in page and "50,000 / $0.12" in page


def test_a_month_closed_before_batches_reads_as_none():
    old = {"tenant": "acme", "deployment": "chat", "version": 1, "model": "m", "usd": "1.5", "prompt_tokens": 10,
           "completion_tokens": 5, "compliant_tokens": 15, "replica_minutes": 0, "revenue": None,
           "adjustment_from": None}
    cell = Cell.from_json(old)
    assert (cell.batch_prompt_tokens, cell.batch_completion_tokens, cell.batch_usd, cell.batch_revenue) == (
        0, 0, Decimal(0), None)
    assert Cell.from_json(cell.as_json()) == cell
    frozen = {"start": "2026-01-01T00:00:00+00:00", "end": "2026-02-01T00:00:00+00:00", "total_usd": "1.5000",
              "idle_usd": "0.0000", "revenue_usd": None, "prompt_tokens": 10, "completion_tokens": 5,
              "slo_compliant_tokens": 15, "replica_hours": "0.00", "usd_per_mtok": "100000.0000",
              "usd_per_mtok_slo_compliant": "100000.0000", "margin_usd": None, "by_deployment": [],
              "by_model": [], "by_version": [], "adjustments": [],
              "by_tenant": [{"tenant": "acme", "usd": "1.5000", "idle_usd": "0.0000", "revenue_usd": None,
                             "deployments": []}],
              "rows": [{**old, "usd": "1.5000"}]}
    assert "batch_usd" not in report_in_cents(frozen)
    [header, row, total] = list(csv.reader(io.StringIO(report_csv(frozen))))
    assert dict(zip(header, row, strict=True))["batch_usd"] == "0.0000"
    assert dict(zip(header, total, strict=True))["batch_tokens"] == "0"


def test_late_batch_usage_in_a_closed_month_is_booked_with_its_batch_figures():
    Tenant.objects.create(name="acme")
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=datetime(2026, 3, 31, 23, tzinfo=UTC))
    usage("chat", "acme", datetime(2026, 3, 31, 23, 5, tzinfo=UTC), prompt=10, completion=10)
    april = datetime(2026, 4, 1, 1, 0, tzinfo=UTC)
    ledger_sync(april)
    services.month_close(month=datetime(2026, 3, 1).date(), now=april)
    usage("chat", "acme", datetime(2026, 3, 31, 23, 10, tzinfo=UTC), prompt=30, completion=0, batch_id="batch_late")
    later = datetime(2026, 4, 1, 2, 0, tzinfo=UTC)
    sync = ledger_sync(later)
    assert services.adjustments_book(since=sync.earliest_change, now=later) == 1
    [moved] = Adjustment.objects.all()
    # The hour's $0.60 now splits 50 : 30 weighted tokens, the batch's 30 of them new.
    assert (moved.prompt_tokens, moved.batch_prompt_tokens, moved.usd) == (30, 30, Decimal(0))
    assert moved.batch_usd == Decimal("0.225")
    assert services.adjustments_book(since=sync.earliest_change, now=later) == 0


def test_batch_price_is_the_list_price_less_its_discount_at_that_time():
    assert services.batch_price("chat", "acme", at(0)) is None  # no list price
    list_price("chat", "2", "6", at(-24))
    list_price("chat", "4", "12", at(-24), tenant="beta", batch_discount_percent=Decimal("12.5"))
    list_price("chat", "2", "6", at(24), batch_discount_percent=Decimal(0))
    assert services.batch_price("chat", "acme", at(0)) == (Decimal(1), Decimal(3))
    assert services.batch_price("chat", "beta", at(0)) == (Decimal("3.5"), Decimal("10.5"))
    assert services.batch_price("chat", "acme", at(25)) == (Decimal(2), Decimal(6))  # no discount from then
    assert services.batch_price("chat", "beta", at(25)) == (Decimal("3.5"), Decimal("10.5"))  # its own price
    assert services.batch_price("chat", "acme", at(-25)) is None  # before any list price
    assert services.batch_price("embed", "acme", at(0)) is None


def test_the_list_price_api_takes_and_shows_the_batch_discount(api):
    operator = api("operator")
    payload = {"deployment": "chat", "usd_per_mtok_prompt": "1.00", "usd_per_mtok_completion": "4.00",
               "effective_from": at(-24).isoformat()}
    created = operator.post("/api/v1/costing/list-prices/", payload, format="json")
    assert created.status_code == 201 and created.json()["batch_discount_percent"] == "50.00"
    for bad in ("100.01", "-1", 30.5):
        response = operator.post("/api/v1/costing/list-prices/",
                                 {**payload, "tenant": "beta", "batch_discount_percent": bad}, format="json")
        assert response.status_code == 400 and "batch_discount_percent" in str(response.json()), response.json()
    own = operator.post("/api/v1/costing/list-prices/", {**payload, "tenant": "beta", "batch_discount_percent": "30"},
                        format="json")
    assert own.status_code == 201 and own.json()["batch_discount_percent"] == "30.00"
    listed = {row["tenant"]: row["batch_discount_percent"]
              for row in api("viewer").get("/api/v1/costing/list-prices/").json()["results"]}
    assert listed == {"": "50.00", "beta": "30.00"}
