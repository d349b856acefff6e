"""Allocation to tenants, idle cost, $/MTok and $/MTok SLO-compliant, the REST report, CSV and PDF."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.utils import timezone
from pypdf import PdfReader

from costing.ledger import ledger_sync
from costing.models import Price
from costing.report import apportion, compute_cells, month_range, rate_text, report_for, report_in_cents
from slo.models import Slo
from tests.costing.conftest import T0, at, make_deployment, make_replica, price, usage
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat():
    """One replica of `chat` (1 core at $0.60/h: $0.01 a minute) from 10:00 to 13:00."""
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0))
    return deployment


def test_two_tenants_at_three_to_one_tokens_get_three_to_one_of_busy_cost_and_idle_is_its_own_line(chat, api):
    usage("chat", "acme", at(0, 5), prompt=100, completion=100, requests=3)   # hour 10: 3:1
    usage("chat", "beta", at(0, 6), prompt=100, completion=100, requests=1)
    usage("chat", "acme", at(1, 5), prompt=50, completion=0)                 # hour 11: acme alone
    ledger_sync(at(3))                                                        # hour 12: no traffic, idle
    body = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03"}).json()
    tenants = {row["tenant"]: row for row in body["by_tenant"]}
    assert tenants["acme"]["usd"] == "1.0500"  # 3/4 of hour 10 ($0.45) + all of hour 11 ($0.60)
    assert tenants["beta"]["usd"] == "0.1500"  # 1/4 of hour 10
    assert body["idle_usd"] == "0.6000"       # hour 12
    assert body["total_usd"] == "1.8000"
    assert body["currency"] == "USD" and body["prompt_tokens"] == 450 and body["completion_tokens"] == 400
    [deployment] = body["by_deployment"]
    assert deployment["deployment"] == "chat" and deployment["idle_usd"] == "0.6000"
    assert deployment["replica_hours"] == "3.00"
    assert deployment["usd_per_mtok"] == str((Decimal("1.8") * 10**6 / 850).quantize(Decimal("0.0001")))
    assert tenants["beta"]["usd_per_mtok"] == str((Decimal("0.15") * 10**6 / 200).quantize(Decimal("0.0001")))


def test_the_parts_add_up_to_the_total_to_the_cent(chat):
    for tenant in ("a", "b", "c"):  # thirds of $0.60 and $0.01 minutes that do not divide evenly
        usage("chat", tenant, at(0, 5), prompt=7, completion=3)
    usage("chat", "a", at(1, 2), prompt=1, completion=1)
    usage("chat", "b", at(1, 3), prompt=1, completion=0)
    for tenant in ("a", "b", "c"):  # thirds of the 37 minutes of hour 12: $0.12333...
        usage("chat", tenant, at(2, 10), prompt=1, completion=1)
    ledger_sync(at(2, 37))
    from costing.report import build_report, daily_series

    report = build_report(at(0), at(3), compute_cells(at(0), at(3)), daily=daily_series(at(0), at(3)))
    total = Decimal(report["total_usd"])
    assert total == Decimal("1.5700")
    tenant_sum = sum(Decimal(row["usd"]) for row in report["by_tenant"]) + Decimal(report["idle_usd"])
    deployment_sum = sum(Decimal(row["usd"]) for row in report["by_deployment"])
    row_sum = sum(Decimal(row["usd"]) for row in report["rows"])
    assert tenant_sum == deployment_sum == row_sum == total
    third = Decimal("0.37") / 3
    exact = {"a": Decimal("0.7") + third, "b": Decimal("0.3") + third, "c": Decimal("0.2") + third}
    for row in report["by_tenant"]:
        assert abs(Decimal(row["usd"]) - exact[row["tenant"]]) <= Decimal("0.0001")


def test_apportion_keeps_the_total():
    parts = apportion([Decimal(1) / 3] * 3)
    assert parts == [Decimal("0.3334"), Decimal("0.3333"), Decimal("0.3333")]
    assert sum(parts) == Decimal("1.0000")


def test_slo_compliant_tokens_are_those_of_requests_meeting_every_latency_slo(chat, api):
    Slo.objects.create(name="chat-ttft", deployment=chat, sli_kind="latency", ttft_ms=200, objective=0.99)
    Slo.objects.create(name="chat-tpot", deployment=chat, sli_kind="goodput", tpot_ms=50, objective=0.99)
    # Only acme is held to e2e <= 800 ms (a tenant-scoped SLO).
    Slo.objects.create(name="acme-e2e", scope="tenant", tenant="acme", deployment=chat, sli_kind="latency",
                       e2e_ms=800, objective=0.99)
    usage("chat", "acme", at(0, 1), prompt=10, completion=10, requests=3)                   # compliant: 60
    usage("chat", "acme", at(0, 2), prompt=10, completion=10, ttft_ms=350)                 # too slow a TTFT
    usage("chat", "acme", at(0, 3), prompt=10, completion=10, tpot_ms=80)                  # too slow a TPOT
    usage("chat", "acme", at(0, 4), prompt=10, completion=10, e2e_ms=900)                  # acme's e2e SLO
    usage("chat", "beta", at(0, 4), prompt=10, completion=10, e2e_ms=900)                  # beta has none: 20
    usage("chat", "beta", at(0, 5), prompt=10, completion=10, status=500, error_kind="internal")  # failed
    ledger_sync(at(1))
    body = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03"}).json()
    assert body["slo_compliant_tokens"] == 80
    assert body["total_usd"] == "0.6000"
    [deployment] = body["by_deployment"]
    assert deployment["usd_per_mtok_slo_compliant"] == "7500.0000"  # $0.60 / 80 tokens
    assert deployment["usd_per_mtok"] == str((Decimal("0.6") * 10**6 / 160).quantize(Decimal("0.0001")))


def test_a_slower_version_costs_more_per_compliant_token(api):
    deployment = make_deployment("chat", resources={"cpu": "1"}, versions=2)
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0), version=1)
    make_replica(deployment, started_at=at(0), version=2, node="node-b")
    Slo.objects.create(name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=200, objective=0.99)
    usage("chat", "acme", at(0, 1), prompt=10, completion=10, version=1, requests=4)
    usage("chat", "acme", at(0, 1), prompt=10, completion=10, version=2, requests=2)
    usage("chat", "acme", at(0, 2), prompt=10, completion=10, version=2, ttft_ms=900, requests=2)
    ledger_sync(at(1))
    body = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03"}).json()
    versions = {row["version"]: row for row in body["by_version"]}
    assert versions[1]["usd_per_mtok"] == versions[2]["usd_per_mtok"] == "7500.0000"
    assert versions[1]["usd_per_mtok_slo_compliant"] == "7500.0000"
    assert versions[2]["usd_per_mtok_slo_compliant"] == "15000.0000"


def test_prompt_and_completion_rates_follow_the_weights(chat, settings):
    usage("chat", "acme", at(0, 1), prompt=400, completion=100)  # weighted 400 + 4 x 100 = 800
    ledger_sync(at(1))
    from costing.report import build_report

    report = build_report(at(0), at(1), compute_cells(at(0), at(1)), daily=[])
    # $0.60 per 800 weighted tokens: a prompt token $0.00075, a completion token 4x that.
    assert report["usd_per_mtok_prompt"] == "750.0000"
    assert report["usd_per_mtok_completion"] == "3000.0000"


def test_revenue_and_margin_at_list_prices(chat, api):
    usage("chat", "acme", at(0, 1), prompt=100_000, completion=50_000)
    usage("chat", "beta", at(0, 1), prompt=100_000, completion=0)
    ledger_sync(at(1))
    operator = api("operator")
    assert operator.post("/api/v1/costing/list-prices/", {
        "deployment": "chat", "usd_per_mtok_prompt": "1.00", "usd_per_mtok_completion": "4.00",
        "effective_from": at(-24).isoformat()}, format="json").status_code == 201
    assert operator.post("/api/v1/costing/list-prices/", {
        "deployment": "chat", "tenant": "beta", "usd_per_mtok_prompt": "0.50", "usd_per_mtok_completion": "2.00",
        "effective_from": at(-24).isoformat()}, format="json").status_code == 201
    body = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03"}).json()
    tenants = {row["tenant"]: row for row in body["by_tenant"]}
    assert tenants["acme"]["revenue_usd"] == "0.3000"  # 0.1 x $1 + 0.05 x $4
    assert tenants["beta"]["revenue_usd"] == "0.0500"  # its own price
    assert body["revenue_usd"] == "0.3500" and body["margin_usd"] == "-0.2500"


def test_csv_has_one_row_per_tenant_deployment_version_and_adds_up(chat, api):
    usage("chat", "acme", at(0, 5), prompt=300, completion=300)
    usage("chat", "beta", at(0, 6), prompt=100, completion=100)
    ledger_sync(at(2))
    response = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03", "format": "csv"})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    body = {(r["tenant"], r["deployment"], r["version"]): r for r in rows}
    assert set(body) == {("acme", "chat", "1"), ("beta", "chat", "1"), ("(idle)", "chat", "1"), ("TOTAL", "", "")}
    assert body[("acme", "chat", "1")]["usd"] == "0.4500" and body[("acme", "chat", "1")]["prompt_tokens"] == "300"
    assert body[("(idle)", "chat", "1")]["usd"] == "0.6000"
    assert body[("TOTAL", "", "")]["usd"] == "1.2000"
    assert sum(Decimal(r["usd"]) for k, r in body.items() if k[0] != "TOTAL") == Decimal("1.2000")


def _pdf_pages(response) -> list[str]:
    assert response.status_code == 200 and response["Content-Type"] == "application/pdf"
    return [page.extract_text() for page in PdfReader(io.BytesIO(response.content)).pages]


def test_pdf_report_has_the_figures_and_the_charts(chat, api):
    usage("chat", "acme", at(0, 5), prompt=300, completion=300)
    usage("chat", "beta", at(0, 6), prompt=100, completion=100)
    ledger_sync(at(2))
    response = api("viewer").get("/api/v1/costing/report/", {"month": "2026-03", "format": "pdf"})
    text = "\n".join(_pdf_pages(response))
    for expected in ("Serving costs 2026-03-01", "Total cost (USD)", "1.20", "acme", "beta", "0.45", "0.15",
                     "idle (no traffic)", "Daily cost by deployment (USD)", "Cost by tenant (USD)", "chat"):
        assert expected in text, expected
    assert "1.2000" not in text and "0.4500" not in text  # money reads in cents
    # The charts are vector drawings: bars are rectangles filled in the palette's first colour
    # (one day of one deployment, two tenants), besides the tables' header backgrounds.
    reader = PdfReader(io.BytesIO(response.content))
    content = "".join(page.get_contents().get_data().decode("latin-1") for page in reader.pages)
    assert ".141176 .32549 .831373 rg" in content
    assert len(re.findall(r"\bre [fB]\*", content)) >= 3 + 1 + 2


def test_the_pdf_names_currency_generated_at_prices_allocation_and_pages(chat, api):
    price("cpu", "0.45", at(-72), tier="spot")
    price("gpu:H100", "2.49", at(-24 * 40), effective_to=at(-24 * 20))  # ended before March: not in effect
    api("operator").post("/api/v1/costing/list-prices/", {
        "deployment": "chat", "usd_per_mtok_prompt": "0.000125", "usd_per_mtok_completion": "1234.5",
        "effective_from": at(-24).isoformat()}, format="json")
    usage("chat", "acme", at(0, 5), prompt=1_234_567, completion=300, requests=2)
    ledger_sync(at(2))
    before = timezone.now().replace(second=0, microsecond=0)
    pages = _pdf_pages(api("viewer").get("/api/v1/costing/report/", {"month": "2026-03", "format": "pdf"}))
    after = timezone.now()
    text = "\n".join(pages)
    assert "Amounts in USD ($)" in text and "Cost (USD)" in text and "Idle (USD)" in text
    generated = datetime.strptime(re.search(r"Generated (\S+ \S+) UTC", text).group(1), "%Y-%m-%d %H:%M:%S")
    assert before <= generated.replace(tzinfo=UTC) <= after
    assert "2,469,134" in text  # prompt tokens, with separators
    for row in ("cpu (on-demand) core-hour 0.60 2026-03-09 10:00 UTC open",
                "cpu (spot) core-hour 0.45 2026-03-07 10:00 UTC open",
                "list price chat, every tenant, prompt 1M prompt tokens 0.000125 2026-03-09 10:00 UTC open",
                "list price chat, every tenant, completion 1M completion tokens 1,234.50"):
        assert row in " ".join(text.split()), row
    assert "gpu:H100" not in text
    assert "Allocation method" in text
    assert "prompt tokens x 1 + completion tokens x 4" in " ".join(text.split())
    assert "idle: its cost goes to no tenant" in " ".join(text.split())
    assert len(pages) >= 2
    for number, page in enumerate(pages, start=1):
        assert f"Page {number} of {len(pages)}" in page


def test_a_back_dated_price_is_noted_on_the_report_and_a_timely_one_is_not(chat, api):
    usage("chat", "acme", at(0, 5), prompt=10, completion=10)
    ledger_sync(at(2))
    Price.objects.filter(resource="cpu").update(created_at=at(-24, 30))  # entered on time
    assert report_for(*month_range(T0.date()), now=at(2))["notes"] == []
    Price.objects.filter(resource="cpu").update(created_at=at(30))  # entered the day after it applied from
    [note] = report_for(*month_range(T0.date()), now=at(2))["notes"]
    assert note.startswith("Back-dated price: cpu (on-demand) at $0.60 per core-hour from 2026-03-09 10:00 UTC "
                           "was added on 2026-03-11 16:00 UTC")
    pages = _pdf_pages(api("viewer").get("/api/v1/costing/report/", {"month": "2026-03", "format": "pdf"}))
    assert "Back-dated price: cpu (on-demand)" in pages[0]


def test_report_in_cents_keeps_every_table_adding_up_to_the_cent(chat):
    for tenant in ("a", "b", "c"):  # thirds of an hour's $0.60 and of odd minutes
        usage("chat", tenant, at(0, 5), prompt=7, completion=3)
    usage("chat", "a", at(1, 2), prompt=1, completion=1)
    usage("chat", "b", at(1, 3), prompt=1, completion=0)
    for tenant in ("a", "b", "c"):
        usage("chat", tenant, at(2, 10), prompt=1, completion=1)
    ledger_sync(at(2, 37))
    exact = report_for(at(0), at(3), now=at(3))
    shown = report_in_cents(exact)
    total = Decimal(shown["total_usd"])
    assert total == Decimal(exact["total_usd"]).quantize(Decimal("0.01"))
    cents = Decimal("0.01")
    tenants = [Decimal(row["usd"]) for row in shown["by_tenant"]]
    assert all(value == value.quantize(cents) for value in tenants)
    assert sum(tenants) + Decimal(shown["idle_usd"]) == total
    assert sum(Decimal(row["usd"]) for row in shown["by_deployment"]) == total
    assert sum(Decimal(row["idle_usd"]) for row in shown["by_version"]) == Decimal(shown["idle_usd"])
    for tenant in shown["by_tenant"]:
        assert sum(Decimal(row["usd"]) for row in tenant["deployments"]) == Decimal(tenant["usd"])
        assert tenant["busy_usd"] == tenant["usd"]
    assert exact["total_usd"] == "1.5700"  # the report itself keeps hundredths of a cent


@pytest.mark.parametrize(("value", "text"), [
    ("0.000833", "0.000833"), ("0.500000", "0.50"), ("2", "2.00"), ("1234.5", "1234.50"), ("0.0400", "0.04")])
def test_unit_prices_keep_their_precision_but_read_at_least_cents(value, text):
    assert rate_text(Decimal(value)) == text


@pytest.mark.parametrize(("params", "field"), [
    ({"month": "2026-13"}, "month"), ({"month": "March"}, "month"), ({"month": "2099-01"}, "month"),
    ({"start": "yesterday", "end": "2026-03-02T00:00:00Z"}, "start"),
    ({"start": "2026-03-02T00:00:00Z", "end": "2026-03-01T00:00:00Z"}, "end"),
    ({"month": "2026-03", "start": "2026-03-01T00:00:00Z"}, "month"),
])
def test_bad_report_periods_are_400_naming_the_field(api, params, field):
    response = api("viewer").get("/api/v1/costing/report/", params)
    assert response.status_code == 400 and field in response.json()


def test_a_period_by_start_and_end_is_whole_hours(chat, api):
    usage("chat", "acme", at(0, 5), prompt=10, completion=10)
    ledger_sync(at(3))
    body = api("viewer").get("/api/v1/costing/report/", {
        "start": at(0, 20).isoformat(), "end": at(1, 10).isoformat()}).json()
    assert (body["start"], body["end"]) == (at(0).isoformat(), at(2).isoformat())
    assert body["total_usd"] == "1.2000" and body["idle_usd"] == "0.6000"


def test_the_report_needs_a_role(api):
    assert api(None).get("/api/v1/costing/report/").status_code == 401
    assert api("viewer").get("/api/v1/costing/report/").status_code == 200


def test_the_report_refuses_a_stranger_whatever_the_format_and_answers_errors_in_json(api):
    # Found by the REST fuzzer (issue 40): DRF negotiated `format` before authenticating (an unknown one was a 404
    # to anyone), and an error asked for as CSV or PDF was rendered as CSV or PDF, not the schema's JSON.
    url = "/api/v1/costing/report/"
    for query in ("format=xml", "format=csv", "format=pdf&month=bad"):
        stranger = api(None).get(f"{url}?{query}")
        assert (stranger.status_code, stranger["Content-Type"]) == (401, "application/json")
        assert_answer_matches_schema(stranger, "GET", url)
    viewer = api("viewer")
    unknown = viewer.get(f"{url}?format=xml")
    assert (unknown.status_code, unknown.json()) == (400, {"format": ["One of: json, csv, pdf."]})
    assert_answer_matches_schema(unknown, "GET", url)
    bad_month = viewer.get(f"{url}?format=csv&month=bad")
    assert (bad_month.status_code, bad_month["Content-Type"]) == (400, "application/json")
    assert "month" in bad_month.json()
    assert_answer_matches_schema(bad_month, "GET", url)
    assert viewer.get(f"{url}?format=csv")["Content-Type"].startswith("text/csv")
