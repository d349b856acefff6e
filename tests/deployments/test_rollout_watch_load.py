"""The watch after a rollout compares like with like (issue 35): a change of load is not blamed on the new
version, a slower version still is.

Pass by pass on the clock of tests/deployments/test_rollouts.py's world: real rows, routing table,
usage events and scraped per-minute replica metrics read by the SLO gate's SQL; replicas in memory.
Traffic is spread evenly over time at a set rate per replica, so "the load triples" is exact.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from deployments.models import Deployment, ReplicaMetricsMinute, Rollout, RolloutMeasurement
from deployments.rollouts import services as rollouts
from deployments.rollouts.spec import normalise
from inferops.api import Conflict
from inferops.models import AuditEvent
from slo.models import SloStatus
from slo.rollout_gate import worse_p_value
from slo.services import slo_create
from tenants.models import UsageEvent
from tests.deployments.conftest import start

pytestmark = pytest.mark.django_db(transaction=True)

SLOW_MS, FAST_MS = 400.0, 50.0  # against the SLO's 200 ms


def ttft_slo(world):
    return slo_create(actor=world.user, name="chat-ttft", scope="deployment", deployment=world.deployment,
                      sli_kind="latency", ttft_ms=200, objective=0.99, window="1d", budgeting="occurrences")


def traffic(world, replicas, *, per_replica_per_s: float, seconds: float, slow_every: int = 0,
            queue: float | None = None) -> None:
    """Requests that started over the `seconds` before the world's clock, evenly spread: each replica
    serves `per_replica_per_s`; every `slow_every`-th is slow (0: none, 1: all). With `queue`, the scraper
    saw that many requests waiting on each replica in those minutes."""
    count = round(per_replica_per_s * seconds)
    for replica in replicas:
        for index in range(count):
            slow = slow_every and index % slow_every == 0
            UsageEvent.objects.create(
                request_id=uuid.uuid4().hex, time=world.now - timedelta(seconds=seconds * (count - index) / count),
                deployment="chat", version=replica.version.number, replica=replica.pk, endpoint="chat", stream=True,
                prompt_tokens=10, completion_tokens=8, ttft_ms=SLOW_MS if slow else FAST_MS, tpot_ms=10.0,
                e2e_ms=150.0, status=200)
        if queue is not None:
            minute = (world.now - timedelta(seconds=seconds)).replace(second=0, microsecond=0)
            while minute < world.now:
                ReplicaMetricsMinute.objects.update_or_create(
                    replica=replica, start=minute, defaults={
                        "deployment_id": replica.deployment_id, "version_id": replica.version_id, "scrapes": 4,
                        "waiting_avg": queue, "waiting_max": queue * 2, "running_avg": 8, "running_max": 8})
                minute += timedelta(minutes=1)


def promote_at(world, rate: float, **kwargs) -> Rollout:
    """v1 → v2 (the same checkpoint: an identical version) by a 50% canary whose analysis passes, with
    every replica serving `rate` requests per second, all fast; succeeded, in its watch."""
    start(world, version=2, steps=[{"set_weight": 50}, {"analysis": {"duration": "30s", "min_requests": 10}}],
          watch="10m", **kwargs)
    world.tick()
    world.tick()  # 50 % on the candidate
    for _ in range(3):
        world.tick(10)
        traffic(world, world.live(), per_replica_per_s=rate, seconds=10)
    world.tick(1)  # the analysis passed; the second candidate replica starts
    world.tick()
    rollout = world.rollout()
    assert rollout.status == "succeeded" and rollout.watching, rollout.message
    return rollout


def watch_for(world, seconds: int, **traffic_args) -> list[RolloutMeasurement]:
    """`seconds` of the watch in 10 s passes, with this traffic on v2 (and its holdback, if any) in each."""
    for _ in range(seconds // 10):
        world.now += timedelta(seconds=10)
        for version, args in traffic_args.items():
            traffic(world, world.live(int(version[1:])), seconds=10, **args)
        world.now -= timedelta(seconds=10)
        world.tick(10)
    watched = Rollout.objects.filter(deployment=world.deployment, rollback=False).order_by("-id").first()
    return list(RolloutMeasurement.objects.filter(rollout=watched, step_index=len(watched.steps)).order_by("taken_at"))


def test_identical_version_is_not_rolled_back_when_the_load_triples_beside_its_holdback(world):
    """The machine slows down under three times the load: v2 and the held-back v1 alike."""
    ttft_slo(world)
    rollout = promote_at(world, 1.0)
    assert world.weights() == {"stable": 95, "holdback": 5}
    looks = watch_for(world, 90, v2={"per_replica_per_s": 3.0, "slow_every": 3},
                      v1={"per_replica_per_s": 0.3, "slow_every": 3})
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and rollout.watching
    assert {look.verdict for look in looks} == {"running"}
    last = looks[-1]
    assert last.stable["concurrent"] is True and last.stable["requests"] >= 10
    check = last.checks[0]
    assert check["candidate"] > 2 and check["ok"] is None and check["p_value"] >= 0.01  # burns, as v1 does
    assert check["basis"] == "same time" and "not worse than the held-back version beside it" in check["note"]
    assert last.candidate["load"]["requests_per_s_per_replica"] == pytest.approx(3.0, rel=0.05)


def test_identical_version_is_not_rolled_back_when_the_load_triples_and_it_queues(world):
    """Without a holdback (0%), v2 is compared with v1 before it: three times the requests per replica,
    a queue on every replica, a third of them slow. Load, not the version: never rolled back."""
    ttft_slo(world)
    rollout = promote_at(world, 1.0, holdback=0)
    assert world.weights() == {"stable": 100} and world.live(1) == []
    looks = watch_for(world, 90, v2={"per_replica_per_s": 3.0, "slow_every": 3, "queue": 4.0})
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and rollout.watching
    assert {look.verdict for look in looks} == {"running"}
    last = looks[-1]
    assert last.checks[0]["candidate"] > 2 and last.checks[0]["ok"] is None
    assert "requests per replica with 4 requests waiting per replica" in last.checks[0]["note"]
    assert "not judged: chat-ttft burn rate: the new version carried 3.8×" in last.reason
    # v1's rate over the rollout's span, which starts at the wall clock's creation time: 0.77 and a bit.
    assert ", 4 waiting; previous 0.77" in last.reason
    assert last.candidate["load"]["requests_per_s_per_replica"] == pytest.approx(3.0, rel=0.05)
    assert last.stable["load"]["requests_per_s_per_replica"] < 1  # v1 before, at the old load

    # The load drops back and v2 is as fast as v1 was: the watch goes on, nothing to blame.
    looks = watch_for(world, 30, v2={"per_replica_per_s": 1.0})
    assert world.rollout().status == "succeeded" and looks[-1].verdict == "running"


def test_identical_version_is_not_blamed_for_its_queue_beside_a_lighter_holdback(world):
    """The holdback's replica takes 5% of the traffic, v2's replicas the rest: under three times the load
    only v2 queues and turns slow. Its share per replica, not the version, explains that."""
    ttft_slo(world)
    rollout = promote_at(world, 1.0)
    looks = watch_for(world, 60, v2={"per_replica_per_s": 3.0, "slow_every": 2, "queue": 6.0},
                      v1={"per_replica_per_s": 0.3})
    assert world.rollout().pk == rollout.pk and world.rollout().status == "succeeded"
    check = looks[-1].checks[0]
    assert looks[-1].stable["concurrent"] is True and check["ok"] is None and check["basis"] == "before"
    # Worse than its holdback, and not by chance (p < 0.01), but at ten times its share per replica;
    # against v1 before the switch: at almost four times the load, with a queue. Load, not the version.
    assert check["same_time"]["p_value"] < 0.01 and "carried 10.0× the previous one's" in check["same_time"]["note"]
    assert "carried 3.8× the previous one's requests per replica with 6 requests waiting" in check["note"]


def test_slower_version_is_still_rolled_back_beside_its_holdback(world):
    ttft_slo(world)
    rollout = promote_at(world, 1.0)
    looks = watch_for(world, 60, v2={"per_replica_per_s": 1.0, "slow_every": 1},
                      v1={"per_replica_per_s": 1.0})
    rollout.refresh_from_db()
    assert rollout.status == "rolled_back", [look.reason for look in looks]
    failed = looks[-1]
    assert failed.verdict == "fail" and failed.stable["concurrent"] is True
    assert "at the same time" in rollout.message
    # 10 s of traffic per look, looked at 12 s after the switch: 10/12 req/s on each replica of both versions.
    assert "load: new 0.833 req/s per replica on 2; previous 0.833 req/s per replica on 1." in rollout.message


def test_slower_version_is_rolled_back_against_the_past_while_its_holdback_cannot_tell(world):
    """A fifth of v2's requests are slow; v1's small holdback served too few to show that by itself."""
    ttft_slo(world)
    rollout = promote_at(world, 1.0)
    looks = watch_for(world, 40, v2={"per_replica_per_s": 1.0, "slow_every": 5}, v1={"per_replica_per_s": 0.3})
    rollout.refresh_from_db()
    assert rollout.status == "rolled_back", [look.reason for look in looks]
    failed = looks[-1]
    assert failed.verdict == "fail" and failed.stable["concurrent"] is True and failed.stable["requests"] == 12
    check = failed.checks[0]
    assert check["basis"] == "before" and check["ok"] is False and check["stable"] == 0.0  # v1 before the switch
    assert "before it" in rollout.message and "Persisted for 30s" in rollout.message


def test_slower_version_is_still_rolled_back_without_a_holdback_once_the_burn_persists(world):
    ttft_slo(world)
    rollout = promote_at(world, 1.0, holdback=0)
    looks = watch_for(world, 30, v2={"per_replica_per_s": 1.0, "slow_every": 1})
    # Three looks (0, 10 and 20 s into the burn) each find it; the failure must persist for 30 s.
    assert [look.verdict for look in looks[-3:]] == ["running"] * 3
    assert "Rolled back if it persists for 30s (seen for 20s)" in looks[-1].reason
    assert looks[-1].checks[0]["ok"] is False
    assert world.rollout().status == "succeeded"
    looks = watch_for(world, 10, v2={"per_replica_per_s": 1.0, "slow_every": 1})
    rollout.refresh_from_db()
    assert rollout.status == "rolled_back" and looks[-1].verdict == "fail"
    assert "before it" in rollout.message and "Persisted for 30s" in rollout.message


def test_a_burst_that_passes_is_not_rolled_back(world):
    """Without a holdback, one slow stretch of the new version is not enough: the burn must persist."""
    ttft_slo(world)
    rollout = promote_at(world, 1.0, holdback=0)
    looks = watch_for(world, 20, v2={"per_replica_per_s": 1.0, "slow_every": 1})
    assert looks[-1].checks[0]["ok"] is False
    looks = watch_for(world, 40, v2={"per_replica_per_s": 3.0, "queue": 0.2})  # more traffic, all fast
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and {look.verdict for look in looks} == {"running"}
    check = looks[-1].checks[0]
    assert check["candidate"] > 2 and check["ok"] is None  # since the rollout it still burns, but not lately
    assert check["note"] == "burns 0.0 over its latest 60 requests: no longer failing"


def test_worse_p_value_is_fishers_exact_test():
    # Values from the hypergeometric tail, worked by hand: all 20 bad vs 0 of 1 → 1/21; 0 of 2 → 1/231.
    assert worse_p_value(20, 20, 0, 1) == pytest.approx(1 / 21)
    assert worse_p_value(20, 20, 0, 2) == pytest.approx(1 / 231)
    assert worse_p_value(5, 10, 5, 10) == pytest.approx(0.6719, abs=1e-4)
    assert worse_p_value(3, 10, 0, 0) == 1.0  # nothing to compare with
    assert worse_p_value(0, 500, 40, 500) == pytest.approx(1.0)


def test_undo_after_an_automatic_rollback_redeploys_the_rejected_version_only_with_a_reason(
        world, api, client, make_user):
    ttft_slo(world)
    rejected = promote_at(world, 1.0)
    watch_for(world, 20, v2={"per_replica_per_s": 1.0, "slow_every": 1}, v1={"per_replica_per_s": 1.0})
    rejected.refresh_from_db()
    assert rejected.status == "rolled_back"
    world.tick()
    world.tick()
    assert world.rollout().pk == rejected.rolled_back_by_id and world.rollout().status == "succeeded"

    ci = api("operator")
    response = ci.post("/api/v1/deployments/chat/rollouts/undo/", {}, format="json")
    assert response.status_code == 400, response.content
    assert "Undo would redeploy v2, which the platform rolled back in rollout" in response.json()["reason"][0]
    assert Rollout.objects.count() == 2  # nothing started

    client.force_login(make_user("operator", "console-operator"))
    html = client.get("/deployments/chat/").content.decode()
    assert "Undo would <strong>redeploy v2</strong>, which the platform rolled back" in html
    assert 'name="reason" maxlength="500" required' in html

    # A redeploy is a rollout like any other: refused while the budget is spent.
    SloStatus.objects.filter(slo__name="chat-ttft").update(budget_remaining=-0.5, state="exhausted")
    response = ci.post("/api/v1/deployments/chat/rollouts/undo/", {"reason": "fixed the tokenizer"},
                           format="json")
    assert response.status_code == 409 and "Error budget exhausted" in response.json()["detail"]
    with pytest.raises(Conflict):
        rollouts.rollout_undo(deployment=world.deployment, actor=world.user, reason="fixed the tokenizer")

    response = ci.post("/api/v1/deployments/chat/rollouts/undo/",
                           {"reason": "fixed the tokenizer", "override_reason": "the fix is the way out"},
                           format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["rollback"] is False and body["candidate"]["version"] == 2 and body["strategy"] == "canary"
    assert body["steps"] == rejected.steps and body["watch_s"] == 600.0 and body["holdback_percent"] == 5
    assert body["override_reason"] == "the fix is the way out"
    assert body["timeline"][1]["event"] == "redeploys a rejected version"
    assert f"rolled back by the platform in rollout {rejected.pk}" in body["timeline"][1]["detail"]
    assert "fixed the tokenizer" in body["timeline"][1]["detail"]
    audit = AuditEvent.objects.get(action="rollout.redeploy_rejected")
    assert audit.after == {"rejected_by_platform_in": rejected.pk, "reason": "fixed the tokenizer"}


def test_undo_from_the_console_asks_why_before_redeploying_a_rejected_version(world, client, make_user):
    ttft_slo(world)
    rejected = promote_at(world, 1.0)
    watch_for(world, 20, v2={"per_replica_per_s": 1.0, "slow_every": 1}, v1={"per_replica_per_s": 1.0})
    world.tick()
    world.tick()
    client.force_login(make_user("operator", "console-operator"))
    response = client.post("/deployments/chat/rollouts/undo/", {"reason": "  "}, follow=True)
    assert "Say why it should serve again" in response.content.decode()
    assert Rollout.objects.count() == 2
    response = client.post("/deployments/chat/rollouts/undo/", {"reason": "fixed the tokenizer"}, follow=True)
    redeploy = Rollout.objects.order_by("-id").first()
    assert redeploy.candidate_version.number == 2 and not redeploy.rollback
    assert f"Redeploying v2, which the platform had rolled back (rollout {redeploy.pk}" in response.content.decode()
    assert Deployment.objects.get(pk=world.deployment.pk).version.number == 1  # until the canary gets through
    assert rejected.pk != redeploy.pk



@pytest.mark.parametrize("strategy, spec", [
    ("canary", {"steps": [{"set_weight": 20}, {"pause": {}}, {"analysis": {"duration": "1m", "min_events": 40}}]}),
    ("blue-green", {"preview": {}, "analysis": "2m", "scale_down_delay": "5m"}),
    ("blue-green", {"preview": "30s"}),
    ("blue-green", {}),
])
def test_a_redeploy_runs_the_rejected_rollouts_strategy_again(strategy, spec):
    steps, delay = normalise(strategy, **spec)
    rejected = Rollout(strategy=strategy, steps=steps, scale_down_delay_s=delay)
    assert normalise(strategy, **rollouts._strategy_args(rejected)) == (steps, delay)
