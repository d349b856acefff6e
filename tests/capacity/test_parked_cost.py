"""A parked hour costs nothing: the ledger charges replica runs, and a parked deployment runs none."""

from __future__ import annotations

import pytest

from costing.ledger import ledger_sync
from costing.report import report_for
from deployments.models import Replica
from tests.costing.conftest import _costing_settings, at, make_deployment, make_replica, price, usage  # noqa: F401

pytestmark = pytest.mark.django_db


def test_an_hour_parked_costs_nothing_and_its_idle_line_falls_to_zero():
    always_on = make_deployment("always-on", resources={"cpu": "1"})
    parking = make_deployment("parking", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))  # $0.60 a replica-hour
    for deployment in (always_on, parking):
        make_replica(deployment, started_at=at(0))
        usage(deployment.name, "acme", at(0, 5), prompt=100, completion=100)  # hour 10: busy
    ledger_sync(at(1))
    # At 11:00 `parking` parks: its only replica stops; `always-on` idles through hour 11 on its replica.
    Replica.objects.filter(deployment=parking).update(state="stopped", stopped_at=at(1), updated_at=at(1))
    ledger_sync(at(2))
    report = report_for(at(0), at(2), now=at(2))
    rows = {row["deployment"]: row for row in report["by_deployment"]}
    assert rows["always-on"]["idle_usd"] == "0.6000" and rows["always-on"]["usd"] == "1.2000"
    assert rows["parking"]["idle_usd"] == "0.0000" and rows["parking"]["usd"] == "0.6000"
    assert rows["parking"]["replica_hours"] == "1.00"
