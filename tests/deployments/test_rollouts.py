"""Rollouts, pass by pass: the state machine inside real reconcile passes, on a clock the test sets.

The replica processes are replaced by an in-memory driver and /health by a set of healthy URLs
(processes are what tests/e2e/test_rollout_e2e.py uses); everything else is real: Postgres rows,
the routing table in Redis, usage events read by the analysis SQL, alerts and audit records.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError

from alerts.models import Alert
from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, Rollout, RolloutMeasurement
from deployments.replicas import routing
from deployments.rollouts import machine as rollout_machine
from deployments.rollouts import services as rollouts
from deployments.rollouts.spec import normalise, parse_duration
from inferops.api import Conflict
from inferops.models import AuditEvent
from registry.models import Alias
from slo.models import SloStatus
from slo.services import slo_create
from tests.deployments.conftest import start

pytestmark = pytest.mark.django_db(transaction=True)


def test_good_canary_goes_through_every_step_and_moves_the_champion(world):
    slo_create(actor=world.user, name="chat-availability", scope="deployment", deployment=world.deployment,
               sli_kind="availability", objective=0.99, window="1d", budgeting="occurrences")
    rollout = start(world, version=2, steps=[{"set_weight": 25}, {"analysis": {"duration": "60s", "min_requests": 10}},
                                             {"pause": "30s"}, {"set_weight": 50}])
    world.tick()  # the candidate is started at weight 0: warm before any traffic
    assert world.rollout().weight == 0 and len(world.live(2)) == 1
    assert world.weights() == {"stable": 100}
    world.tick()  # ready -> 25 %, then the analysis starts
    rollout.refresh_from_db()
    assert (rollout.weight, rollout.step_index, rollout.status) == (25, 1, "progressing")
    assert world.weights() == {"stable": 75, "candidate": 25}
    assert routing.read_table()["chat--preview"]["versions"][0]["replicas"][0]["id"] == world.live(2)[0].pk

    world.events(world.live(2), 12)
    world.events(world.live(1), 36)
    world.tick(30)
    assert world.rollout().step_index == 1 and "Analysing" in world.rollout().message
    world.tick(31)  # window over: pass, then the pause
    rollout.refresh_from_db()
    assert (rollout.status, rollout.step_index) == ("paused", 2)
    passed = RolloutMeasurement.objects.filter(rollout=rollout, verdict="pass").get()
    assert passed.candidate["requests"] == 12 and passed.stable["requests"] == 36
    assert passed.checks[0]["name"] == "chat-availability burn rate" and passed.checks[0]["candidate"] == 0
    world.tick(10)
    assert world.rollout().status == "paused"
    world.tick(21)  # the pause is over: 50 % needs one candidate replica (of 2): already there
    rollout.refresh_from_db()
    assert rollout.weight == 50 and rollout.step_index == 4 and len(world.live(2)) == 2
    world.tick()  # the second candidate replica is ready: all traffic, deployment on v2
    rollout.refresh_from_db()
    assert rollout.status == "succeeded" and rollout.weight == 100
    deployment = Deployment.objects.get(pk=world.deployment.pk)
    assert deployment.version.number == 2
    # During the watch one v1 replica keeps 5% of the traffic (the default holdback) to compare v2 with.
    assert len(world.live(1)) == 1 and world.weights() == {"stable": 95, "holdback": 5}
    assert "chat--preview" not in routing.read_table()
    assert Alias.objects.get(model=deployment.model, name="champion").version.number == 2
    assert AuditEvent.objects.filter(action="alias.set").exists()
    events = [step["event"] for step in rollout.timeline]
    assert events == ["created", "weight", "analysis passed", "weight", "succeeded", "alias moved"]


def test_candidate_with_errors_is_aborted_and_traffic_returns_at_once(world):
    # A game day: same version, a fault injected through the candidate's engine args.
    start(world, engine_args={"fault_error_rate": 0.5},
          steps=[{"set_weight": 50}, {"analysis": {"duration": "5m", "min_requests": 10}}])
    world.tick()
    world.tick()
    assert world.weights() == {"stable": 50, "candidate": 50}
    candidate = [r for r in world.live() if r.rollout_id][0]
    stable = [r for r in world.live() if not r.rollout_id]
    # The candidate's failures were retried on stable by the gateway: clients saw 200s.
    world.events(stable, 6, failed_replica=candidate.pk)
    world.events([candidate], 6)
    world.events(stable, 20)
    world.tick(20)  # early verdict: no need to wait for the 5 minutes
    rollout = world.rollout()
    assert rollout.status == "aborted" and rollout.weight == 0
    assert "availability (implied) burn rate" in rollout.message
    failed = RolloutMeasurement.objects.get(rollout=rollout, verdict="fail")
    assert failed.candidate["failed_attempts"] == 6 and failed.candidate["error_rate"] == 0.5
    assert world.weights() == {"stable": 100}
    assert Replica.objects.get(pk=candidate.pk).state in (ReplicaState.DRAINING, ReplicaState.STOPPED)
    alert = Alert.objects.get(labels__alertname="RolloutAborted")
    assert alert.status == "firing" and alert.labels["deployment"] == "chat"
    assert alert.annotations["rollout_url"].endswith(f"/deployments/chat/rollouts/{rollout.pk}/")
    assert [e["event"] for e in rollout.timeline][-2:] == ["aborted", "traffic on stable"]
    assert Deployment.objects.get(pk=world.deployment.pk).engine_args == {}

    rollouts.rollout_retry(rollout=rollout, actor=world.user)  # retry resolves the alert and starts over
    alert.refresh_from_db()
    assert alert.status == "resolved" and world.rollout().status == "progressing"


def test_blue_green_promotion_then_instant_rollback_within_the_delay(world):
    start(world, version=2, strategy="blue-green", scale_down_delay="10m")
    world.tick()
    assert len(world.live(2)) == 2 and world.weights() == {"stable": 100}  # candidate at full size, no traffic
    world.tick()  # both ready: preview route then the switch in one pass
    rollout = world.rollout()
    assert rollout.status == "succeeded" and rollout.scale_down_at == world.now + timedelta(minutes=10)
    assert world.weights() == {"stable": 95, "holdback": 5}  # the warm old set is the watch's holdback
    old = world.live(1)
    assert len(old) == 2 and all(r.state == ReplicaState.READY for r in old)  # kept warm

    undo = rollouts.rollout_undo(deployment=world.deployment, actor=world.user)
    assert undo.rollback and undo.candidate_version.number == 1
    world.tick()  # one pass: the warm set takes the traffic back
    assert world.rollout().status == "succeeded"
    assert Deployment.objects.get(pk=world.deployment.pk).version.number == 1
    assert world.weights() == {"stable": 100} and world.live(2) == []
    assert {r.pk for r in world.live(1)} == {r.pk for r in old}


def test_blue_green_old_set_goes_after_the_scale_down_delay(world):
    start(world, version=2, strategy="blue-green", scale_down_delay="5m", promote_alias="")
    world.tick()
    world.tick()
    assert len(world.live(1)) == 2
    world.tick(299)
    assert len(world.live(1)) == 2
    world.tick(2)
    # The delay is over: the old set goes but for the holdback, which stays until the watch (10m) ends.
    assert len(world.live(1)) == 1 and world.weights() == {"stable": 95, "holdback": 5}
    world.tick(300)
    assert world.live(1) == [] and world.weights() == {"stable": 100}
    assert not Alias.objects.filter(name="champion").exists()


def test_blue_green_without_a_watch_keeps_its_old_set_warm_with_no_traffic(world):
    start(world, version=2, strategy="blue-green", scale_down_delay="5m", watch=0)
    world.tick()
    world.tick()
    assert len(world.live(1)) == 2 and world.weights() == {"stable": 100, "previous": 0}
    world.tick(301)
    assert world.live(1) == [] and world.weights() == {"stable": 100}


def test_refused_while_an_error_budget_is_exhausted(world):
    slo = slo_create(actor=world.user, name="chat-latency", scope="deployment", deployment=world.deployment,
                     sli_kind="latency", ttft_ms=200, objective=0.99, window="1d", budgeting="occurrences")
    SloStatus.objects.update_or_create(slo=slo, defaults={"budget_remaining": -0.3})
    with pytest.raises(Conflict, match="chat-latency"):
        start(world, version=2)
    assert not Rollout.objects.exists()
    assert start(world, version=2, rollback=True).rollback
    rollouts.rollout_abort(rollout=world.rollout(), actor=world.user)
    overridden = start(world, version=2, override_reason="hotfix for the outage")
    audit = AuditEvent.objects.get(action="rollout.budget_override")
    assert audit.object_id == str(overridden.pk) and audit.after["reason"] == "hotfix for the outage"


def test_inconclusive_analysis_pauses_for_a_human(world):
    start(world, version=2, steps=[{"set_weight": 50}, {"analysis": {"duration": "30s", "min_requests": 20}}])
    world.tick()
    world.tick()
    world.events([r for r in world.live(2)], 3)
    world.tick(31)
    rollout = world.rollout()
    assert rollout.status == "paused" and "3 candidate requests" in rollout.message
    assert rollout.weight == 50  # holds where it is until someone decides
    world.tick(60)
    assert world.rollout().status == "paused"
    rollouts.rollout_promote(rollout=rollout, actor=world.user)
    world.tick()
    world.tick()
    assert world.rollout().status == "succeeded"


def test_worker_killed_mid_transition_leaves_a_consistent_state(world, monkeypatch):
    start(world, version=2, steps=[])

    def killed(**kwargs):
        raise KeyboardInterrupt("worker killed")

    world.tick()
    monkeypatch.setattr(rollout_machine, "alias_set", killed)
    with pytest.raises(KeyboardInterrupt):
        world.tick()  # dies inside the finalize transaction (after the deployment row was updated)
    assert world.rollout().status == "progressing"
    assert Deployment.objects.get(pk=world.deployment.pk).version.number == 1
    assert world.weights() == {"stable": 100}
    monkeypatch.undo()
    world.tick()
    assert world.rollout().status == "succeeded"
    assert Deployment.objects.get(pk=world.deployment.pk).version.number == 2


def test_crash_looping_candidate_aborts_the_rollout(world):
    world.driver.crashing.add(world.deployment.model.versions.get(number=2).pk)
    start(world, version=2)
    for _ in range(6):
        world.tick()
    rollout = world.rollout()
    assert rollout.status == "aborted" and "crash-looping" in rollout.message
    assert world.live(2) == [] and len(world.live(1)) == 2


def test_one_rollout_at_a_time_and_no_spec_change_behind_its_back(world):
    rollout = start(world, version=2)
    with pytest.raises(Conflict, match=f"Rollout {rollout.pk}"):
        start(world, engine_args={"max_num_seqs": 8})
    with pytest.raises(Conflict, match="promote or abort"):
        deployment_services.deployment_update(deployment=world.deployment, actor=world.user, version=1)
    deployment_services.deployment_update(deployment=world.deployment, actor=world.user, replicas=3)  # scaling is fine
    rollouts.rollout_abort(rollout=rollout, actor=world.user)
    with pytest.raises(ValidationError, match="already serves"):
        start(world, version=1)


@pytest.mark.parametrize(("body", "message"), [
    ({"steps": "fast"}, "Expected a list"),
    ({"steps": [{"set_weight": 120}]}, "0-100"),
    ({"steps": [{"set_weight": 10, "pause": "1m"}]}, "one key"),
    ({"steps": [{"wait": "1m"}]}, "unknown step"),
    ({"steps": [{"pause": "soon"}]}, "duration"),
    ({"steps": [{"analysis": {"duration": "1m", "max_burn": 3}}]}, "unknown key"),
    ({"steps": [{"analysis": {"duration": "1m", "thresholds": {"ttft_p99": 1}}}]}, "unknown"),
    ({"steps": [{"analysis": {"min_requests": 5}}]}, "duration: required"),
    ({"scale_down_delay": "1m"}, "applies to blue-green"),
])
def test_bad_canary_specs_are_refused_with_the_field_named(body, message):
    with pytest.raises(ValidationError, match=message):
        normalise("canary", **body)


def test_blue_green_spec_and_durations():
    steps, delay = normalise("blue-green", scale_down_delay="1h30m", preview={}, analysis="2m")
    assert delay == 5400 and steps[0] == {"pause": None} and steps[1] == {"set_weight": 100}
    assert steps[2]["analysis"]["duration"] == 120 and steps[2]["analysis"]["min_requests"] == 20
    assert parse_duration(90, "x") == 90 and parse_duration("1.5s", "x") == 1.5
    with pytest.raises(ValueError, match="7 days"):
        parse_duration("200h", "x")
    with pytest.raises(ValidationError, match="no steps"):
        normalise("blue-green", steps=[])
    with pytest.raises(ValidationError, match="Unknown strategy"):
        normalise("linear")


def test_engine_args_alone_cannot_roll_out_on_kubernetes(world):
    Deployment.objects.filter(pk=world.deployment.pk).update(driver="kubernetes")
    world.deployment.refresh_from_db()
    with pytest.raises(ValidationError, match="new version"):
        start(world, engine_args={"max_num_seqs": 8})
    assert not Rollout.objects.exists()
