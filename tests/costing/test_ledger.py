"""The replica-hour ledger on real Postgres: runs observed, priced minute by minute, rolled up hourly."""

from __future__ import annotations

from decimal import Decimal

import pytest

from costing.ledger import costs_compute, ledger_sync, replica_resources
from costing.models import CostHour, ReplicaLife
from deployments.models import Replica
from tests.costing.conftest import at, make_deployment, make_replica, price

pytestmark = pytest.mark.django_db


def hours(deployment: str | None = None) -> dict:
    rows = CostHour.objects.all() if deployment is None else CostHour.objects.filter(deployment=deployment)
    totals: dict = {}
    for row in rows:
        minutes, usd = totals.get(row.hour, (0, Decimal(0)))
        totals[row.hour] = (minutes + row.minutes, usd + row.usd)
    return totals


def test_price_change_mid_hour_prices_each_minute_at_its_own_price():
    make_replica(make_deployment("chat"), started_at=at(0))  # local, no cpu_threads: the host's 4 cores
    price("cpu", "0.10", at(-24))
    price("cpu", "0.40", at(minutes=30))
    ledger_sync(at(1, 0.5))
    # 30 min x 4 cores x $0.10/h + 30 min x 4 cores x $0.40/h
    assert hours() == {at(0): (60, Decimal("1.0"))}
    first = CostHour.objects.get()
    assert first.cpu_usd == Decimal("1.0") and first.gpu_usd == first.memory_usd == first.node_usd == 0


def test_restart_is_two_runs_and_the_gap_between_them_costs_nothing():
    deployment = make_deployment("chat", resources={"cpu": "2", "memory": "8Gi"})
    price("cpu", "0.06", at(-24))
    price("memory", "0.015", at(-24))  # 2 x 0.06 + 8 x 0.015 = $0.24/h = $0.004 a minute
    replica = make_replica(deployment, started_at=at(0))
    ledger_sync(at(minutes=20))
    # The process dies at 10:40; the row says FAILED from its save then.
    Replica.objects.filter(pk=replica.pk).update(state="failed", updated_at=at(minutes=40))
    ledger_sync(at(minutes=41))
    # Restarted at 10:50 on the same row: a new started_at.
    Replica.objects.filter(pk=replica.pk).update(state="ready", started_at=at(minutes=50), restarts=1)
    ledger_sync(at(1, 10.2))
    runs = list(ReplicaLife.objects.order_by("started_at").values_list("started_at", "ended_at"))
    assert runs == [(at(0), at(minutes=40)), (at(minutes=50), None)]
    assert hours() == {at(0): (50, Decimal("0.2")), at(1): (10, Decimal("0.04"))}


def test_a_restart_between_two_looks_ends_the_old_run_where_it_was_last_seen():
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))  # $0.01 a minute
    replica = make_replica(deployment, started_at=at(0))
    ledger_sync(at(minutes=10))
    Replica.objects.filter(pk=replica.pk).update(started_at=at(minutes=30), restarts=1)
    ledger_sync(at(minutes=45))
    runs = list(ReplicaLife.objects.order_by("started_at").values_list("started_at", "ended_at"))
    assert runs == [(at(0), at(minutes=10)), (at(minutes=30), None)]
    assert hours() == {at(0): (25, Decimal("0.25"))}


def test_running_replica_is_charged_to_the_last_full_minute_and_stopped_one_to_its_stop():
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24))
    make_replica(deployment, started_at=at(0, 0.25))  # 10:00:15: its first minute is charged whole
    make_replica(deployment, started_at=at(0), state="stopped", stopped_at=at(minutes=5), node="node-b")
    ledger_sync(at(minutes=10, hours=0) + (at(0, 0.5) - at(0)))  # 10:10:30
    running = CostHour.objects.get(life__ended_at__isnull=True)
    stopped = CostHour.objects.get(life__ended_at__isnull=False)
    assert (running.minutes, running.usd) == (10, Decimal("0.1"))
    assert (stopped.minutes, stopped.usd) == (5, Decimal("0.05"))


def test_rerunning_a_period_changes_nothing():
    deployment = make_deployment("chat", resources={"cpu": "3", "gpu_type": "H100", "gpu_count": 2})
    price("cpu", "0.07", at(-24))
    price("gpu:H100", "2.49", at(-24))
    price("gpu:H100", "1.99", at(1, 17))
    make_replica(deployment, started_at=at(0, 7))
    make_replica(deployment, started_at=at(0, 13), node="node-b")
    ledger_sync(at(3, 30))
    before = sorted(CostHour.objects.values_list("life_id", "hour", "minutes", "usd"))
    ledger_sync(at(3, 30))
    assert sorted(CostHour.objects.values_list("life_id", "hour", "minutes", "usd")) == before
    costs_compute(at(0), at(3, 30))
    assert sorted(CostHour.objects.values_list("life_id", "hour", "minutes", "usd")) == before
    # A later sync rewrites the current hour only; the finished hours stay as they were.
    ledger_sync(at(3, 45))
    after = sorted(r for r in CostHour.objects.values_list("life_id", "hour", "minutes", "usd") if r[1] < at(3))
    assert after == [r for r in before if r[1] < at(3)]
    # gpu: 2 x $2.49 until 11:17, then 2 x $1.99; cpu: 3 x $0.07, for both replicas.
    first_hour = hours()[at(0)]
    assert first_hour == (53 + 47, (Decimal(53) * (Decimal("4.98") + Decimal("0.21"))
                                    + Decimal(47) * (Decimal("4.98") + Decimal("0.21"))) / 60)


def test_a_node_price_is_shared_by_the_replicas_on_the_node():
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("node:node-a", "1.20", at(-24))
    make_replica(deployment, started_at=at(0))
    make_replica(deployment, started_at=at(minutes=30))
    ledger_sync(at(1))
    rows = {row.life.started_at: row for row in CostHour.objects.select_related("life")}
    # Alone for 30 minutes ($0.60), then half of $1.20/h for 30 minutes each ($0.30).
    assert rows[at(0)].node_usd == Decimal("0.9")
    assert rows[at(minutes=30)].node_usd == Decimal("0.3")
    assert sum(r.usd for r in rows.values()) == Decimal("1.2")


def test_preferred_tier_first_then_the_others(settings):
    deployment = make_deployment("chat", resources={"cpu": "1"})
    price("cpu", "0.60", at(-24), tier="spot")
    price("cpu", "1.20", at(minutes=30), tier="on-demand")
    make_replica(deployment, started_at=at(0))
    ledger_sync(at(1))
    assert hours() == {at(0): (60, Decimal("0.9"))}  # spot until on-demand exists, then on-demand
    settings.INFEROPS_COST_TIER = "spot"
    costs_compute(at(0), at(1))
    assert hours() == {at(0): (60, Decimal("0.6"))}


@pytest.mark.parametrize(("resources", "engine_args", "driver", "cpus", "memory", "gpus"), [
    ({}, {"cpu_threads": 2}, "local", "2.000", "0.0000", 0),
    ({}, {}, "local", "4.000", "0.0000", 0),  # the host's cores (INFEROPS_COST_LOCAL_CPUS in tests)
    ({"cpu": "500m", "memory": "1536Mi"}, {"cpu_threads": 2}, "local", "0.500", "1.5000", 0),
    ({"gpu_type": "H100", "gpu_count": 2}, {}, "kubernetes", "0.000", "0.0000", 2),
])
def test_what_a_replica_is_charged_for(resources, engine_args, driver, cpus, memory, gpus):
    deployment = make_deployment("chat", resources=resources, engine_args=engine_args)
    replica = Replica(deployment=deployment, driver=driver, engine_args=engine_args)
    held = replica_resources(deployment, replica)
    assert (str(held.cpus), str(held.memory_gib), held.gpu_count) == (cpus, memory, gpus)
