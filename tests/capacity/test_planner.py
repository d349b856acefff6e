"""The capacity planner: one replica's capacity read off a recorded goodput curve, replicas for a rate with
headroom, money from the price book, warnings, and GET /api/v1/capacity/plan/ (shapes, errors, roles)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.utils import timezone

from capacity.choices import CurveSource
from capacity.curves import curve_create, deployment_hardware, held_of_hardware, newest_curve
from capacity.models import CapacityCurve
from capacity.planner import (
    Goal,
    PlanError,
    deployment_capacity,
    deployment_goal,
    make_plan,
    recent_rps,
    replica_capacity,
    replicas_needed,
)
from costing import services as costing_services
from deployments.models import Deployment
from slo.services import slo_create

# Recorded with `inferops bench --rates 4,8,16,24,32,48 --step-seconds 5 --input-len 32 --output-len 32
# --goodput ttft:300 tpot:50` against the tests' tiny Llama served with --max-num-seqs 2 --cpu-threads 1 on a
# 2-core CPU: two sequences at a time make the queue, and TTFT p95, grow once the rate nears ~36 req/s.
RECORDED = [
    {"rps": 4, "throughput_rps": 4.19, "goodput_rps": 4.19, "ttft_p95_ms": 45.96, "tpot_p95_ms": 1.65,
     "completed": 20, "failed": 0},
    {"rps": 8, "throughput_rps": 8.13, "goodput_rps": 8.13, "ttft_p95_ms": 17.04, "tpot_p95_ms": 1.68,
     "completed": 40, "failed": 0},
    {"rps": 16, "throughput_rps": 16.16, "goodput_rps": 16.16, "ttft_p95_ms": 29.88, "tpot_p95_ms": 2.55,
     "completed": 80, "failed": 0},
    {"rps": 24, "throughput_rps": 21.43, "goodput_rps": 21.43, "ttft_p95_ms": 66.11, "tpot_p95_ms": 1.94,
     "completed": 120, "failed": 0},
    {"rps": 32, "throughput_rps": 33.12, "goodput_rps": 33.12, "ttft_p95_ms": 123.14, "tpot_p95_ms": 1.63,
     "completed": 160, "failed": 0},
    {"rps": 48, "throughput_rps": 44.25, "goodput_rps": 29.31, "ttft_p95_ms": 645.25, "tpot_p95_ms": 1.70,
     "completed": 240, "failed": 0},
]
RECORDED_SLO_MS = {"ttft": 300.0, "tpot": 50.0}
NOW = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)


def recorded_curve(**fields) -> CapacityCurve:
    values = {"pk": 7, "points": RECORDED, "slo_ms": RECORDED_SLO_MS, "input_len": 32, "output_len": 32,
              "created_at": NOW - timedelta(days=1), "engine_args": {"max_num_seqs": 2}, "source": CurveSource.BENCH,
              "deployment": "chat", "hardware": "cpu:1", **fields}
    return CapacityCurve(**values)


def plan(goal: Goal, rps: float, headroom: float = 0.2, price: Decimal | None = Decimal("0.5"), same: bool = True,
         **curve) -> dict:
    return make_plan(curve=recorded_curve(**curve), same_engine_args=same, goal=goal, rps=rps, headroom=headroom,
                     usd_per_replica_hour=price, now=NOW, run_hint="POST ...")


# ---------------------------------------------------------------------------------------------------------------
# One replica's capacity


def test_the_capacity_is_where_the_first_criterion_crosses_between_the_last_good_step_and_the_first_bad():
    # TTFT p95 crosses 100 ms between 24 (66.11) and 32 req/s (123.14): 24 + 8 × 33.89 / 57.03.
    capacity = replica_capacity(RECORDED, Goal(ttft_ms=100, tpot_ms=50, objective=0.99))
    assert capacity.limited_by == "ttft_p95" and capacity.method == "slo"
    assert capacity.rps == pytest.approx(24 + 8 * (100 - 66.11) / (123.14 - 66.11))
    assert not capacity.beyond_range and capacity.measured_up_to == 48


def test_goodput_under_the_objective_ends_the_capacity_before_the_p95_does():
    # At 48 req/s both miss: TTFT p95 645 > 300 crosses at 37.4 req/s, but goodput (29.31 of 44.25 served,
    # 66 %) falls under 99 % already at 32 + 16 × 0.01 / (0.01 + 0.3276) = 32.47 req/s.
    capacity = replica_capacity(RECORDED, Goal(ttft_ms=300, tpot_ms=50, objective=0.99))
    assert capacity.limited_by == "goodput"
    share = 29.31 / 44.25
    assert capacity.rps == pytest.approx(32 + 16 * 0.01 / (0.01 + 0.99 - share))
    # Judged on the p95s alone (goodput counted against other thresholds), TTFT ends it later.
    by_p95 = replica_capacity(RECORDED, Goal(ttft_ms=300, tpot_ms=50, objective=0.99), use_goodput=False)
    assert by_p95.limited_by == "ttft_p95"
    assert by_p95.rps == pytest.approx(32 + 16 * (300 - 123.14) / (645.25 - 123.14))


def test_failed_requests_over_the_objective_miss_and_a_step_with_none_completed_misses_outright():
    points = [dict(point) for point in RECORDED[:3]]
    points[2] = {**points[2], "failed": 8, "completed": 72}  # 10 % failed, 1 % allowed
    capacity = replica_capacity(points, Goal(ttft_ms=1000, objective=0.99))
    assert capacity.limited_by == "failed"
    assert capacity.rps == pytest.approx(8 + 8 * 0.01 / (0.01 + 0.09))
    points[2] = {**points[2], "failed": 80, "completed": 0, "ttft_p95_ms": None, "throughput_rps": 0.0,
                 "goodput_rps": 0.0}
    nothing = replica_capacity(points, Goal(ttft_ms=1000, objective=0.99))
    assert nothing.rps == 8  # no interpolation towards a step that served nothing


def test_a_curve_that_never_reaches_the_limit_gives_its_highest_rate_and_a_warning():
    capacity = replica_capacity(RECORDED, Goal(ttft_ms=5000, objective=0.9), use_goodput=False)
    assert capacity.beyond_range and capacity.rps == 48 and capacity.limited_by is None
    got = plan(Goal(ttft_ms=5000, objective=0.9), 100, slo_ms={})  # goodput not counted: p95s alone
    assert got["replicas"] == math.ceil(100 / (48 * 0.8))
    assert any("never reached its limit" in warning and "48" in warning for warning in got["warnings"])


def test_even_the_lowest_rate_missing_is_an_error_saying_what_to_do():
    with pytest.raises(PlanError, match=r"lowest rate, 4 req/s, misses \(TTFT p95 46 ms > 10 ms\).*lower rates"):
        replica_capacity(RECORDED, Goal(ttft_ms=10, objective=0.99))
    with pytest.raises(PlanError, match="no points"):
        replica_capacity([], Goal(ttft_ms=10))


def test_without_latency_targets_the_capacity_is_the_throughput_knee():
    # Throughput keeps up with the rate (>= 95 %) to 16 req/s (101 %), not at 24 (21.43, 89 %).
    capacity = replica_capacity(RECORDED, Goal())
    assert capacity.method == "throughput-knee" and capacity.limited_by == "throughput"
    at_16, at_24 = 16.16 / 16 - 0.95, 21.43 / 24 - 0.95
    assert capacity.rps == pytest.approx(16 + 8 * at_16 / (at_16 - at_24))
    # Against the rate a step really sent where the curve has it: 24 req/s offered, 22 sent, 21.43 served keeps up.
    sent = [dict(point) for point in RECORDED]
    sent[3] = {**sent[3], "sent_rps": 22.0}
    assert replica_capacity(sent, Goal()).rps > 24
    assert any("throughput knee" in warning for warning in plan(Goal(), 10)["warnings"])


# ---------------------------------------------------------------------------------------------------------------
# Replicas and money


def test_replicas_with_headroom_and_twice_the_rate_needs_more():
    goal = Goal(ttft_ms=100, tpot_ms=50, objective=0.99)
    capacity = replica_capacity(RECORDED, goal).rps  # 28.75 req/s
    assert replicas_needed(0, capacity, 0.2) == 0
    assert replicas_needed(0.001, capacity, 0.2) == 1
    assert replicas_needed(capacity * 0.8, capacity, 0.2) == 1  # exactly full at the headroom
    assert replicas_needed(capacity * 0.8 * 1.01, capacity, 0.2) == 2
    assert replicas_needed(capacity, capacity, 0.0) == 1 and replicas_needed(capacity, capacity, 0.5) == 2
    one, two = plan(goal, 20), plan(goal, 40)
    assert one["replicas"] == 1 and two["replicas"] == 2
    assert plan(goal, 400)["replicas"] == math.ceil(400 / (capacity * 0.8)) == 18
    assert one["usable_rps_per_replica"] == pytest.approx(capacity * 0.8)
    assert one["utilization"] == pytest.approx(20 / capacity)


def test_money_per_hour_month_and_million_tokens():
    got = plan(Goal(ttft_ms=100, tpot_ms=50, objective=0.99), 40, price=Decimal("0.5"))
    assert got["replicas"] == 2
    assert got["usd_per_replica_hour"] == Decimal("0.5") and got["usd_per_hour"] == Decimal("1.0")
    assert got["usd_per_month"] == Decimal("730.0")
    tokens_per_hour = 40 * 3600 * (32 + 32)
    assert got["tokens_per_hour"] == tokens_per_hour
    assert got["usd_per_mtok"] == (Decimal("1.0") / tokens_per_hour * 1_000_000).quantize(Decimal("0.000001"))
    nothing = plan(Goal(ttft_ms=100), 0)
    assert nothing["replicas"] == 0 and nothing["usd_per_hour"] == 0 and nothing["usd_per_mtok"] is None
    unpriced = plan(Goal(ttft_ms=100), 40, price=None)
    assert unpriced["usd_per_hour"] is None and unpriced["usd_per_month"] is None and unpriced["usd_per_mtok"] is None
    assert any("prices nothing" in warning for warning in unpriced["warnings"])


def test_warnings_stale_curve_other_engine_args_and_goodput_counted_against_looser_thresholds():
    fresh = plan(Goal(ttft_ms=300, tpot_ms=50, objective=0.99), 10)
    assert fresh["warnings"] == [] and fresh["goodput_judged"] is True
    assert fresh["curve"]["age_s"] == 86400 and fresh["curve"]["id"] == 7
    old = plan(Goal(ttft_ms=300, tpot_ms=50, objective=0.99), 10, created_at=NOW - timedelta(days=45), same=False)
    assert any("45 days old" in warning for warning in old["warnings"])
    assert any("other engine arguments" not in w and "at these engine arguments" in w for w in old["warnings"])
    assert old["curve"]["same_engine_args"] is False
    # The SLO tightened to 200 ms TTFT since: goodput at 300 ms says nothing of it.
    tighter = plan(Goal(ttft_ms=200, tpot_ms=50, objective=0.99), 10)
    assert tighter["goodput_judged"] is False and tighter["limited_by"] == "ttft_p95"
    assert any("counted goodput against" in warning for warning in tighter["warnings"])
    # A looser SLO is judged on the curve's (tighter) goodput: cautious, not wrong.
    assert plan(Goal(ttft_ms=400, tpot_ms=60, objective=0.99), 10)["goodput_judged"] is True


def test_hardware_keys_read_back_as_what_they_price():
    assert held_of_hardware("gpu:H100x2").gpu_count == 2 and held_of_hardware("gpu:H100x2").gpu_type == "H100"
    assert held_of_hardware("cpu:0.5").cpus == Decimal("0.5")
    assert held_of_hardware("kubernetes:unsized") is None and held_of_hardware("a lot") is None


# ---------------------------------------------------------------------------------------------------------------
# Against the database: the deployment's hardware, SLOs, curves and prices


@pytest.mark.django_db
@pytest.mark.parametrize(("driver", "resources", "engine_args", "key"), [
    ("local", {}, {"cpu_threads": 2}, "cpu:2"),
    ("local", {"cpu": "500m"}, {}, "cpu:0.5"),
    ("kubernetes", {"gpu_count": 1, "gpu_type": "H100", "cpu": "8"}, {}, "gpu:H100x1"),
    ("kubernetes", {}, {}, "kubernetes:unsized"),
])
def test_a_deployments_hardware_is_named_from_what_costing_charges_it_for(driver, resources, engine_args, key):
    deployment = SimpleNamespace(driver=driver, resources=resources, engine_args=engine_args)
    assert deployment_hardware(deployment) == key


@pytest.fixture
def chat(deployment) -> Deployment:
    Deployment.objects.filter(pk=deployment.pk).update(engine_args={"cpu_threads": 2, "max_num_seqs": 2})
    deployment.refresh_from_db()
    slo_create(actor=None, name="chat-latency", deployment=deployment, sli_kind="latency", ttft_ms=300, tpot_ms=50,
               objective=0.99)
    costing_services.price_create(resource="cpu", usd_per_hour=Decimal("0.05"),
                                  effective_from=timezone.now() - timedelta(days=1), actor=None)
    return deployment


def store(deployment: Deployment, **fields) -> CapacityCurve:
    values = {"version": deployment.version, "hardware": deployment_hardware(deployment),
              "engine_args": deployment.engine_args, "deployment": deployment.name, "source": CurveSource.BENCH,
              "input_len": 32, "output_len": 32, "slo_ms": RECORDED_SLO_MS, "points": RECORDED, "actor": None,
              **fields}
    return curve_create(**values)


@pytest.mark.django_db
def test_the_plan_api_answers_replicas_money_and_the_curve_it_used(api, chat):
    store(chat, engine_args={"max_num_seqs": 64})  # other engine arguments: not the one used
    used = store(chat)
    got = api("viewer").get("/api/v1/capacity/plan/?deployment=chat&rps=40&headroom=0.2")
    assert got.status_code == 200, got.json()
    body = got.json()
    assert (body["deployment"], body["model"], body["version"], body["hardware"]) == ("chat", "tiny", 1, "cpu:2")
    assert body["curve"]["id"] == used.pk and body["curve"]["same_engine_args"] is True
    assert body["curve"]["age_s"] < 60 and body["curve"]["points"] == RECORDED
    assert body["slo"] == {"ttft_ms": 300.0, "tpot_ms": 50.0, "objective": 0.99}
    assert body["limited_by"] == "goodput" and body["capacity_rps_per_replica"] == pytest.approx(32.47, abs=0.01)
    assert body["replicas"] == 2 and body["headroom"] == 0.2
    # cpu:2 at $0.05 a core-hour: $0.10 a replica-hour.
    assert (body["usd_per_replica_hour"], body["usd_per_hour"], body["usd_per_month"]) == (
        "0.100000", "0.200000", "146.000000")
    assert Decimal(body["usd_per_mtok"]) == (Decimal("0.2") / (40 * 3600 * 64) * 1_000_000).quantize(
        Decimal("0.000001"))
    assert body["warnings"] == []
    twice = api("viewer").get("/api/v1/capacity/plan/?deployment=chat&rps=80").json()
    assert twice["replicas"] > body["replicas"]


@pytest.mark.django_db
def test_a_curve_at_other_engine_arguments_is_used_saying_so(api, chat):
    store(chat, engine_args={"max_num_seqs": 64})
    body = api("viewer").get("/api/v1/capacity/plan/?deployment=chat&rps=5").json()
    assert body["curve"]["same_engine_args"] is False
    assert any("max_num_seqs" in warning for warning in body["warnings"])


@pytest.mark.django_db
def test_plan_by_model_version_and_hardware(api, chat):
    store(chat)
    body = api("viewer").get("/api/v1/capacity/plan/?model=tiny&version=1&hardware=cpu:2&rps=10").json()
    assert body["deployment"] is None and body["replicas"] == 1
    # The model's SLOs only (chat's is a deployment SLO): no targets, so the throughput knee.
    assert body["capacity_method"] == "throughput-knee" and body["usd_per_replica_hour"] == "0.100000"
    assert any("hardware key alone" in warning for warning in body["warnings"])


@pytest.mark.django_db
@pytest.mark.parametrize(("query", "field", "says"), [
    ("rps=10", "deployment", "Give deployment, or model, version and hardware."),
    ("deployment=nope&rps=10", "deployment", "No deployment named 'nope'."),
    ("deployment=chat", "rps", "This field is required."),
    ("deployment=chat&rps=-1", "rps", "Ensure this value is greater than or equal to 0."),
    ("deployment=chat&rps=abc", "rps", "A valid number is required."),
    ("deployment=chat&rps=nan", "rps", "A valid number is required."),
    ("deployment=chat&rps=1e400", "rps", "A valid number is required."),
    ("deployment=chat&rps=5&headroom=1", "headroom", "Ensure this value is less than or equal to 0.9."),
    ("deployment=chat&rps=5&model=tiny", "model", "Give deployment or model, version and hardware, not both."),
    ("model=tiny&version=1&rps=5", "hardware", "Give it with the others, or deployment alone."),
    ("model=tiny&version=9&hardware=cpu:2&rps=5", "version", "Model 'tiny' has no version 9."),
    ("model=tiny&version=x&hardware=cpu:2&rps=5", "version", "A valid integer is required."),
])
def test_the_plan_api_names_what_is_wrong(api, chat, query, field, says):
    store(chat)
    got = api("viewer").get(f"/api/v1/capacity/plan/?{query}")
    assert got.status_code == 400 and got.json() == {field: [says]}, got.json()


@pytest.mark.django_db
def test_no_curve_says_to_run_a_capacity_run_first_and_a_curve_that_cannot_meet_the_slo_says_so(api, chat):
    got = api("viewer").get("/api/v1/capacity/plan/?deployment=chat&rps=10")
    assert got.status_code == 400
    assert "run a capacity run first: POST /api/v1/deployments/chat/capacity-runs/" in got.json()["detail"]
    store(chat, points=[{**RECORDED[0], "ttft_p95_ms": 900.0}])
    got = api("viewer").get("/api/v1/capacity/plan/?deployment=chat&rps=10")
    assert got.status_code == 400 and "Even the curve's lowest rate" in got.json()["detail"]


@pytest.mark.django_db
def test_the_plan_is_read_by_viewers_and_refused_to_strangers(api, chat):
    store(chat)
    assert api(None).get("/api/v1/capacity/plan/?deployment=chat&rps=1").status_code == 401
    assert api("viewer").post("/api/v1/capacity/plan/?deployment=chat&rps=1").status_code == 403
    assert api("operator").post("/api/v1/capacity/plan/?deployment=chat&rps=1").status_code == 405


@pytest.mark.django_db
def test_newest_curve_and_the_deployments_capacity_for_the_autoscaler(chat):
    assert newest_curve(chat.version, "cpu:2", chat.engine_args) == (None, False)
    assert deployment_capacity(chat) is None
    store(chat)
    capacity = deployment_capacity(chat)
    assert capacity.limited_by == "goodput" and capacity.rps == pytest.approx(32.47, abs=0.01)
    assert deployment_goal(chat) == Goal(300.0, 50.0, 0.99)


@pytest.mark.django_db
def test_current_traffic_is_the_interactive_requests_of_the_last_15_whole_minutes(chat):
    from tenants.models import UsageMinute

    now = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC)
    for minutes_ago, requests, batch in ((1, 900, 0), (15, 900, 300), (16, 5000, 0), (0, 5000, 0)):
        UsageMinute.objects.create(minute=now.replace(second=0) - timedelta(minutes=minutes_ago), tenant="acme",
                                   key_prefix="k", deployment="chat", version=1, requests=requests,
                                   batch_requests=batch)
    # Minutes 1 and 15 before the current one count (the current one is not over, the 16th is out): 1500 / 900 s.
    assert recent_rps(chat, now) == pytest.approx(1500 / 900)
