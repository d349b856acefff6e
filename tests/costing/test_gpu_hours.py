"""The cost report's GPU-hours and the share of them that were busy, from the ledger and the replicas'
hourly GPU telemetry; hours no telemetry covered are "not measured", never 0 % busy."""

from __future__ import annotations

import csv
import io

import pytest
from pypdf import PdfReader

from costing.ledger import ledger_sync
from costing.models import ReplicaLife
from deployments.models import ReplicaMetricsHour
from tests.costing.conftest import at, make_deployment, make_replica, price, usage
from tests.deployments.metrics_helpers import metrics_row

pytestmark = pytest.mark.django_db
MONTH = {"month": "2026-03"}
H100_X2 = {"gpu_type": "nvidia-h100", "gpu_count": 2, "cpu": "1"}


def telemetry(replica, hour: float, *, minutes: int, util: float, devices: int = 2):
    return metrics_row(ReplicaMetricsHour, replica, at(hour), scrapes=4 * minutes, gpu_devices=devices,
                       gpu_scrapes=4 * minutes, gpu_minutes=minutes, gpu_util_avg=util, gpu_util_max=util)


@pytest.fixture
def gpus():
    """`chat` on one replica of 2 H100s and `embed` on one of 2 H100s without GPU telemetry, from 10:00 to
    13:00 (6 GPU-hours each), and `cpu`, which holds no GPU."""
    price("gpu:nvidia-h100", "2.00", at(-24))
    price("cpu", "0.60", at(-24))
    chat = make_replica(make_deployment("chat", resources=H100_X2), started_at=at(0))
    make_replica(make_deployment("embed", resources=H100_X2), started_at=at(0), node="node-b")
    make_replica(make_deployment("cpu", resources={"cpu": "1"}), started_at=at(0), node="node-c")
    usage("chat", "acme", at(0, 5), prompt=100, completion=100)
    # 10:00-11:00 measured throughout at 50 %; 11:00-12:00 only its first half, at 80 %; 12:00-13:00 not at all.
    telemetry(chat, 0, minutes=60, util=50.0)
    telemetry(chat, 1, minutes=30, util=80.0)
    ledger_sync(at(3))
    return chat


def test_busy_share_of_the_measured_gpu_hours_and_the_rest_not_measured(gpus, api):
    body = api("viewer").get("/api/v1/costing/report/", MONTH).json()
    rows = {row["deployment"]: row for row in body["by_deployment"]}
    # Measured: 2 GPUs x 60 min + 2 x 30 min = 3 GPU-hours, busy 2 x 60 x 50 % + 2 x 30 x 80 % = 1.8 of them.
    assert {key: rows["chat"][key] for key in ("gpu_hours", "gpu_hours_measured", "gpu_hours_busy",
                                               "gpu_busy_share", "gpu_hours_not_measured")} == {
        "gpu_hours": "6.00", "gpu_hours_measured": "3.00", "gpu_hours_busy": "1.80", "gpu_busy_share": "0.6000",
        "gpu_hours_not_measured": "3.00"}
    # No telemetry at all: not measured, not 0 % busy.
    assert (rows["embed"]["gpu_hours"], rows["embed"]["gpu_busy_share"], rows["embed"]["gpu_hours_not_measured"]) \
        == ("6.00", None, "6.00")
    assert (rows["cpu"]["gpu_hours"], rows["cpu"]["gpu_busy_share"]) == ("0.00", None)
    # The whole report: 12 GPU-hours, 1.8 busy of the 3 measured.
    assert (body["gpu_hours"], body["gpu_hours_busy"], body["gpu_busy_share"], body["gpu_hours_not_measured"]) == (
        "12.00", "1.80", "0.6000", "9.00")
    # A tenant holds no GPUs: its lines carry no GPU figures.
    assert not any(key.startswith("gpu_") for key in body["by_tenant"][0])


def test_a_restart_within_an_hour_counts_that_hours_telemetry_once(api):
    price("gpu:nvidia-h100", "2.00", at(-24))
    replica = make_replica(make_deployment("chat", resources=H100_X2), started_at=at(0))
    telemetry(replica, 0, minutes=60, util=40.0)
    ledger_sync(at(0, 30))
    replica.started_at = at(0, 30)  # a second run of the same replica row, in the same hour
    replica.save()
    ledger_sync(at(1))
    assert ReplicaLife.objects.filter(replica=replica).count() == 2
    body = api("viewer").get("/api/v1/costing/report/", MONTH).json()
    assert (body["gpu_hours"], body["gpu_hours_busy"], body["gpu_busy_share"]) == ("2.00", "0.80", "0.4000")


def test_csv_pdf_and_console_show_gpu_hours_and_not_measured(gpus, api, client, make_user):
    response = api("viewer").get("/api/v1/costing/report/", {**MONTH, "format": "csv"})
    rows = {(r["tenant"], r["deployment"]): r for r in csv.DictReader(io.StringIO(response.content.decode()))}
    gpu = ("gpu_hours", "gpu_hours_busy", "gpu_busy_share", "gpu_hours_not_measured")
    # A version's GPU-hours are on its idle line, as its replica hours are.
    assert [rows[("(idle)", "chat")][key] for key in gpu] == ["6.00", "1.80", "0.6000", "3.00"]
    assert [rows[("(idle)", "embed")][key] for key in gpu] == ["6.00", "0.00", "not measured", "6.00"]
    assert [rows[("(idle)", "cpu")][key] for key in gpu] == ["", "", "", ""]
    assert [rows[("acme", "chat")][key] for key in gpu] == ["", "", "", ""]
    assert [rows[("TOTAL", "")][key] for key in gpu] == ["12.00", "1.80", "0.6000", "9.00"]

    pdf = api("viewer").get("/api/v1/costing/report/", {**MONTH, "format": "pdf"})
    text = " ".join(" ".join(page.extract_text() for page in PdfReader(io.BytesIO(pdf.content)).pages).split())
    assert "GPU-hours Busy GPU-hours GPU busy GPU-hours not measured" in text
    assert "chat 6.00 1.80 60.0 % 3.00" in text and "embed 6.00 0.00 not measured 6.00" in text
    assert "Total 12.00 1.80 60.0 % 9.00" in text

    client.force_login(make_user("viewer"))
    page = client.get("/costs/", MONTH).content.decode()
    assert 'id="gpu-hours">12.00 · 60.0 % (9.00 GPU-hours not measured)<' in page
    assert '<td class="num gpu-busy">60.0 % (3.00 GPU-hours not measured)</td>' in page
    assert '<td class="num gpu-busy">not measured</td>' in page
    assert 'id="gpu-busy-method"' in page


def test_a_month_closed_before_gpu_telemetry_shows_no_gpu_figures(gpus, client, make_user):
    from costing.models import ClosedMonth
    from costing.report import Cell, gpu_busy_text, report_csv

    closed_cell = {"tenant": None, "deployment": "chat", "version": 1, "model": "m", "usd": "1", "prompt_tokens": 0,
                   "completion_tokens": 0, "compliant_tokens": 0, "replica_minutes": 60, "revenue": None}
    assert Cell.from_json(closed_cell).gpu_minutes == 0
    old = {"start": "2026-02-01T00:00:00+00:00", "end": "2026-03-01T00:00:00+00:00", "total_usd": "1.0000",
           "prompt_tokens": 0, "completion_tokens": 0, "slo_compliant_tokens": 0, "replica_hours": "1.00",
           "usd_per_mtok": None, "usd_per_mtok_slo_compliant": None, "revenue_usd": None, "margin_usd": None,
           "rows": [{**closed_cell, "usd": "1.0000"}]}
    assert gpu_busy_text(old) == ""
    assert report_csv(old).splitlines()[1].endswith(",,,,")
    ClosedMonth.objects.create(month="2026-02-01", closed_at=at(-24 * 20), cells=[closed_cell], report={
        **old, "currency": "USD", "closed": True, "closed_at": at(-24 * 20).isoformat(), "ledger_through": None,
        "idle_usd": "1.0000", "busy_usd": "0.0000", "token_weights": {"prompt": "1", "completion": "4"},
        "by_tenant": [], "by_deployment": [{"deployment": "chat", "model": "m", "usd": "1.0000",
                                            "idle_usd": "1.0000", "replica_hours": "1.00", "total_tokens": 0,
                                            "usd_per_mtok": None, "usd_per_mtok_slo_compliant": None}],
        "by_model": [], "by_version": [], "daily": [], "adjustments": [], "notes": []})
    client.force_login(make_user("viewer"))
    page = client.get("/costs/", {"month": "2026-02"}).content.decode()
    assert page.count('class="num gpu-busy">—<') == 1 and 'id="gpu-hours"' not in page
