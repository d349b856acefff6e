"""The watch after a rollout succeeds (automatic rollback) and rollouts frozen by a degradation level,
pass by pass on the clock of tests/deployments/test_rollouts.py's world: real rows, routing table,
usage events read by the SLO gate's SQL, alerts and audit records; replicas in memory.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from alerts.models import Alert
from deployments import services as deployment_services
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts import services as rollouts
from inferops.api import Conflict
from inferops.models import AuditEvent
from registry.models import Alias
from slo.services import slo_create
from tests.deployments.conftest import start

pytestmark = pytest.mark.django_db(transaction=True)

FROZEN = {"level": 1, "name": "protect", "freeze_rollouts": True, "shed_below_priority": 5}


def ttft_slo(world):
    return slo_create(actor=world.user, name="chat-ttft", scope="deployment", deployment=world.deployment,
                      sli_kind="latency", ttft_ms=200, objective=0.99, window="1d", budgeting="occurrences")


def succeed(world, **kwargs) -> Rollout:
    """A canary to v2 whose analysis passes on healthy traffic (stable serving beside it), then succeeds."""
    start(world, version=2, steps=[{"set_weight": 50}, {"analysis": {"duration": "30s", "min_requests": 10}}],
          **kwargs)
    world.tick()
    world.tick()  # 50 % on the candidate
    world.tick(20)
    world.events(world.live(2), 12)
    world.events(world.live(1), 30)
    world.tick(11)  # analysis passed; the second candidate replica starts
    world.tick()
    rollout = world.rollout()
    assert rollout.status == "succeeded", rollout.message
    return rollout


def set_degradation(world, degradation):
    Deployment.objects.filter(pk=world.deployment.pk).update(degradation=degradation)
    world.deployment.refresh_from_db()


def test_new_version_that_burns_beside_its_holdback_is_rolled_back_by_the_platform(world):
    ttft_slo(world)
    rollout = succeed(world, watch="5m")
    assert rollout.watch_until == rollout.finished_at + timedelta(minutes=5) and rollout.watching
    assert rollout.holdback_percent == 5 and world.weights() == {"stable": 95, "holdback": 5}
    held = world.live(1)
    assert len(held) == 1  # one v1 replica of the two serves the holdback
    world.tick(10)  # a look with nothing to judge yet
    look = RolloutMeasurement.objects.get(rollout=rollout, step_index=len(rollout.steps))
    assert look.verdict == "running" and "judging needs 10" in look.reason

    world.events(world.live(2), 25, ttft_ms=400)  # v2 turns slow after it took over...
    world.events(held, 12)  # ... while v1 beside it, at the same time, stays fast
    world.tick(4)
    assert RolloutMeasurement.objects.filter(rollout=rollout, step_index=2).count() == 1  # one look per 10 s
    world.tick(6)
    rollout.refresh_from_db()
    assert rollout.status == "rolled_back" and not rollout.watching
    assert "burns an SLO the previous one did not at the same time" in rollout.message
    assert "chat-ttft burn rate: new 100.0, previous 0.0, limit 2.0" in rollout.message
    assert "load: new " in rollout.message and "req/s per replica on 2" in rollout.message
    assert rollout.timeline[-1]["event"] == "rolled back"
    failed = RolloutMeasurement.objects.get(rollout=rollout, verdict="fail")
    assert failed.candidate["requests"] == 25 and failed.stable["requests"] == 12  # v1 at the same time
    assert failed.stable["concurrent"] is True and failed.checks[0]["p_value"] < 0.01
    assert failed.candidate["load"]["replicas"] == 2 and failed.stable["load"]["replicas"] == 1
    rollback = rollout.rolled_back_by
    assert (rollback.rollback, rollback.strategy, rollback.candidate_version.number) == (True, "blue-green", 1)
    assert rollback.created_by is None and rollback.watch_until is None
    audit = AuditEvent.objects.get(action="rollout.auto_rollback")
    assert audit.object_id == str(rollout.pk) and audit.actor_name == "system"
    alert = Alert.objects.get(labels__alertname="RolloutRolledBack")
    assert alert.status == "firing" and alert.severity == "ticket" and alert.labels["rollout"] == str(rollout.pk)
    assert alert.annotations["rollout_url"].endswith(f"/deployments/chat/rollouts/{rollout.pk}/")

    # The undo path: the held-back v1 replica is warm already; one more starts, then v1 takes it all back.
    assert world.weights() == {"stable": 100, "candidate": 0}
    world.tick()
    assert len(world.live(1)) == 2 and held[0].pk in {r.pk for r in world.live(1)}
    world.tick()
    assert world.rollout().pk == rollback.pk and world.rollout().status == "succeeded"
    assert Deployment.objects.get(pk=world.deployment.pk).version.number == 1
    assert world.live(2) == [] and world.weights() == {"stable": 100}
    assert Alias.objects.get(name="champion").version.number == 1
    alert.refresh_from_db()
    assert alert.status == "firing"  # the rollback's success leaves the ticket for a human
    world.tick(10)
    assert RolloutMeasurement.objects.filter(rollout=rollback).count() == 0  # a rollback is never watched


def test_turned_off_during_the_watch_the_platform_leaves_a_burning_version_alone(world):
    ttft_slo(world)
    rollout = succeed(world, watch="1m")
    world.events(world.live(2), 20)
    world.tick(10)
    assert "every SLO within its limit" in RolloutMeasurement.objects.get(rollout=rollout, step_index=2).reason

    rollouts.rollout_set_auto_rollback(rollout=rollout, actor=world.user, auto_rollback=False)
    world.events(world.live(2), 40, ttft_ms=400)
    world.tick(10)
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and not rollout.watching and rollout.in_watch(world.now)
    assert RolloutMeasurement.objects.filter(rollout=rollout, step_index=2).count() == 1  # no look while off
    assert world.live(1) == [] and world.weights() == {"stable": 100}  # nothing to compare with: no holdback
    assert rollout.timeline[-1]["event"] == "auto-rollback off"
    assert AuditEvent.objects.filter(action="rollout.update", object_id=str(rollout.pk)).exists()

    Rollout.objects.filter(pk=rollout.pk).update(auto_rollback=True)  # on again, too late: the watch is over
    world.tick(50)
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and not rollout.in_watch(world.now)
    assert RolloutMeasurement.objects.filter(rollout=rollout, step_index=2).count() == 1


def test_no_rollback_when_the_previous_version_burned_as_well(world):
    ttft_slo(world)
    rollout = succeed(world)
    v1 = list(world.deployment.replica_set.filter(version__number=1))
    world.events(v1, 40, ttft_ms=400, at=rollout.finished_at - timedelta(seconds=5))  # v1 was slow already
    world.events(world.live(2), 40, ttft_ms=400)
    world.tick(10)
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and rollout.watching
    look = RolloutMeasurement.objects.get(rollout=rollout, step_index=2)
    assert look.verdict == "running" and look.checks[0]["ok"] is None  # not judged: both burn
    assert look.stable["requests"] == 70


def test_a_later_change_of_the_deployment_ends_the_watch(world):
    rollout = succeed(world)
    deployment_services.deployment_update(deployment=world.deployment, actor=world.user, version=1)
    world.tick()
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and rollout.watch_until == world.now and not rollout.in_watch(world.now)
    assert rollout.timeline[-1]["event"] == "watch ended"


def test_a_frozen_deployment_refuses_new_rollouts_and_holds_a_running_canary(world):
    rollout = start(world, version=2, steps=[{"set_weight": 25}, {"pause": "30s"}, {"set_weight": 50}])
    world.tick()
    world.tick()  # 25 %, then the pause
    set_degradation(world, FROZEN)
    world.tick(40)  # the pause would be over: frozen, it holds
    rollout.refresh_from_db()
    assert (rollout.weight, rollout.step_index, rollout.status) == (25, 1, "paused")
    assert rollout.message.startswith("Frozen by degradation level 1 (protect): the weight holds at 25%")
    assert rollout.frozen_since == world.now and rollout.timeline[-1]["event"] == "frozen"
    assert world.weights() == {"stable": 75, "candidate": 25}
    with pytest.raises(Conflict, match="frozen by degradation level 1"):
        rollouts.rollout_promote(rollout=rollout, actor=world.user, full=True)
    world.tick(10)
    assert [e["event"] for e in world.rollout().timeline].count("frozen") == 1

    set_degradation(world, None)
    world.tick()  # unfrozen: the pause starts over
    rollout.refresh_from_db()
    assert rollout.frozen_since is None and rollout.timeline[-1]["event"] == "unfrozen"
    assert (rollout.weight, rollout.status, rollout.step_started_at) == (25, "paused", world.now)
    world.tick(31)
    assert world.rollout().weight == 50


def test_rollbacks_go_ahead_while_frozen(world):
    set_degradation(world, FROZEN)
    with pytest.raises(Conflict) as refused:
        start(world, version=2)
    assert "degradation level 1 (protect), which freezes rollouts" in str(refused.value.detail)
    assert "rollback" in str(refused.value.detail) and "degradation/override/" in str(refused.value.detail)
    assert not Rollout.objects.exists()

    rollback = start(world, version=2, rollback=True, steps=[{"set_weight": 50}])
    world.tick()
    world.tick()
    rollback.refresh_from_db()
    assert rollback.weight == 50 and rollback.frozen_since is None
    rollouts.rollout_abort(rollout=rollback, actor=world.user)
    assert rollouts.rollout_retry(rollout=rollback, actor=world.user).status == "progressing"  # still a rollback
    rollouts.rollout_abort(rollout=rollback, actor=world.user)
    with pytest.raises(Conflict, match="freezes rollouts"):  # the budget override does not lift a freeze
        start(world, version=2, override_reason="hotfix")
