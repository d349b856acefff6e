"""Rollout analysis at low traffic: a burn rate or threshold cannot fail a step on fewer events than
it needs (the step's `min_events`, or enough that one bad event alone stays within the limit),
unless the failure is certain already.

The guard itself is a pure function over the gate's measurement; the last tests run it inside real
reconcile passes with the `world` of test_rollouts.py (real Postgres, Redis and usage ledger).
"""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from deployments.choices import Verdict
from deployments.models import RolloutMeasurement
from deployments.rollouts.gate import Measurement, low_traffic_guard, min_events
from deployments.rollouts.spec import normalise
from tests.deployments.conftest import start

CONFIG = {"duration": 120.0, "min_requests": 20, "max_burn_rate": 2.0, "thresholds": {}}


def burn_measurement(total: int, bad: int, objective: float = 0.99, verdict: str = Verdict.FAIL) -> Measurement:
    burn = round(bad / total / (1 - objective), 3)
    candidate = {"requests": total, "failures": bad, "failed_attempts": 0, "error_rate": bad / total,
                 "slos": {"chat-latency": {"good": total - bad, "total": total, "objective": objective,
                                           "burn_rate": burn}}}
    check = {"name": "chat-latency burn rate", "candidate": burn, "stable": 0.0, "limit": 2.0, "ok": burn <= 2.0}
    return Measurement(verdict, candidate, {"requests": 100, "slos": {}}, [check], "chat-latency burn rate: ...")


def test_default_minimum_is_what_one_bad_event_needs_to_stay_within_the_limit():
    assert min_events("burn", CONFIG, 2.0, 0.99) == 50
    assert min_events("burn", CONFIG, 2.0, 0.999) == 500
    assert min_events("burn", CONFIG, 10.0, 0.99) == 20  # never below min_requests
    assert min_events("error_rate", CONFIG, 0.01) == 100
    assert min_events("ratio", CONFIG, 1.2) == 20
    assert min_events("burn", {**CONFIG, "min_events": 7}, 2.0, 0.99) == 7


def test_one_slow_request_of_twenty_does_not_fail_the_step():
    result = low_traffic_guard(burn_measurement(20, 1), CONFIG, final=False)
    assert result.verdict == Verdict.RUNNING
    check = result.checks[0]
    assert check["ok"] is None and (check["events"], check["min_events"]) == (20, 50)
    assert check["note"] == "20 of 50 requests: not enough to judge yet"
    assert result.reason == "chat-latency burn rate: 20 of 50 requests: not enough to judge yet."


def test_held_back_at_the_end_of_the_window_is_inconclusive():
    result = low_traffic_guard(burn_measurement(12, 1), CONFIG, final=True)
    assert result.verdict == Verdict.INCONCLUSIVE and "12 of 50 requests" in result.reason


def test_a_failure_that_enough_good_events_could_not_undo_fails_at_once():
    # 6 bad of 12: even 38 more good requests would leave a 12x burn.
    result = low_traffic_guard(burn_measurement(12, 6), CONFIG, final=False)
    assert result.verdict == Verdict.FAIL and result.checks[0]["ok"] is False
    assert result.reason == "chat-latency burn rate: ..."  # the gate's own reason, untouched


def test_enough_events_judge_as_before():
    result = low_traffic_guard(burn_measurement(60, 2), CONFIG, final=False)  # 3.3x over 60
    assert result.verdict == Verdict.FAIL
    passing = low_traffic_guard(burn_measurement(60, 1, verdict=Verdict.PASS), CONFIG, final=True)  # 1.7x
    assert passing.verdict == Verdict.PASS and passing.checks[0]["min_events"] == 50


def test_a_step_sets_its_own_minimum():
    result = low_traffic_guard(burn_measurement(20, 1), {**CONFIG, "min_events": 10}, final=False)
    assert result.verdict == Verdict.FAIL
    result = low_traffic_guard(burn_measurement(60, 2), {**CONFIG, "min_events": 200}, final=False)
    assert result.verdict == Verdict.RUNNING and "60 of 200 requests" in result.reason


def test_thresholds_are_guarded_too_and_a_held_check_leaves_the_others_failing():
    candidate = {"requests": 30, "failures": 1, "failed_attempts": 0, "error_rate": 1 / 30, "slos": {}}
    checks = [{"name": "error rate", "candidate": 0.033, "stable": 0.0, "limit": 0.02, "ok": False},
              {"name": "ttft p95 ≤ 1.2× stable", "candidate": 300.0, "stable": 100.0, "limit": 120.0, "ok": False}]
    result = low_traffic_guard(Measurement(Verdict.FAIL, candidate, {}, checks, "both"), CONFIG, final=False)
    error_rate, ttft = result.checks
    assert error_rate["ok"] is None and error_rate["note"] == "30 of 50 requests: not enough to judge yet"
    assert ttft["ok"] is False and result.verdict == Verdict.FAIL
    assert result.reason == "ttft p95 ≤ 1.2× stable: candidate 300.0, stable 100.0, limit 120.0"
    only_ratio = low_traffic_guard(Measurement(Verdict.FAIL, candidate, {}, checks[1:], "r"),
                                   {**CONFIG, "min_events": 100}, final=False)
    assert only_ratio.verdict == Verdict.RUNNING  # a percentile over 30 requests is never certain


def test_spec_takes_min_events_per_analysis_step():
    steps, _ = normalise("canary", steps=[{"set_weight": 10}, {"analysis": {"duration": "1m", "min_events": 200}},
                                          {"analysis": "1m"}])
    assert steps[1]["analysis"]["min_events"] == 200
    assert "min_events" not in steps[2]["analysis"]  # derived per check when the step runs
    for bad in (0, -1, 2.5, "50", True, 10**7):
        with pytest.raises(ValidationError) as caught:
            normalise("canary", steps=[{"analysis": {"duration": "1m", "min_events": bad}}])
        assert "steps[0].analysis.min_events: expected an integer" in str(caught.value)


def test_one_slow_request_does_not_abort_a_canary_and_the_page_says_why(world, client):
    rollout = start(world, version=2, steps=[{"set_weight": 50}, {"analysis": {"duration": "60s"}}])
    world.tick()
    world.tick()
    candidate = world.live(2)
    world.events(candidate, 1, status=500)
    world.events(candidate, 19)
    world.events(world.live(1), 40)
    world.tick(10)
    rollout.refresh_from_db()
    assert rollout.status == "progressing", rollout.message
    assert "20 of 50 requests: not enough to judge yet" in rollout.message
    stored = RolloutMeasurement.objects.filter(rollout=rollout).latest("taken_at")
    assert stored.verdict == "running" and stored.checks[0]["note"] == "20 of 50 requests: not enough to judge yet"

    client.force_login(world.user)
    html = client.get(f"/deployments/chat/rollouts/{rollout.pk}/").content.decode()
    assert "availability (implied) burn rate: 20 of 50 requests: not enough to judge yet" in html

    world.events(candidate, 40)  # 1 bad of 60: 1.7x, within 2x
    world.tick(51)
    rollout.refresh_from_db()
    assert RolloutMeasurement.objects.filter(rollout=rollout, verdict="pass").exists()
    assert rollout.status in ("progressing", "succeeded") and rollout.step_index >= 2
