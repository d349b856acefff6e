"""The autoscaler's decision function on sample series: no processes, no database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capacity.autoscaler import Policy, Sample, Step, Targets, decide, quantile

NOW = 1_800_000_000.0
TICK = 5.0


def series(*loads, replicas=2, ready=None, held_last=False, **fixed):
    """Samples every TICK seconds ending at NOW, oldest first; each load is a dict of Sample fields."""
    count = len(loads)
    samples = []
    for i, load in enumerate(loads):
        at = NOW - (count - 1 - i) * TICK
        fields = {"replicas": replicas, "ready": replicas if ready is None else ready, **fixed, **load}
        samples.append(Sample(at=at, held=held_last and i == count - 1, **fields))
    return samples


def policy(**changes):
    base = {"minimum": 1, "maximum": 4, "signals": {"waiting_per_replica": 2.0, "kv_usage": 0.85},
            "scale_up": Step(1, 30), "scale_down": Step(1, 120), "cooldown_s": 30, "park_after_s": 300}
    return Policy(**{**base, **changes})


def run(samples, current=2, last=None, targets=Targets(), boost=0, **changes):
    return decide(policy=policy(**changes), samples=samples, current=current, last_change_at=last, now=NOW,
                  targets=targets, boost=boost)


BUSY = {"waiting": 10.0, "running": 8.0, "kv": 0.5, "rps": 4.0}   # 5 waiting per replica
QUIET = {"waiting": 0.0, "running": 1.0, "kv": 0.1, "rps": 0.5}
IDLE = {"waiting": 0.0, "running": 0.0, "kv": 0.0, "rps": 0.0}


def test_scales_up_once_the_load_held_over_the_whole_stabilisation_window():
    decision = run(series(*[BUSY] * 7))  # 30 s of samples
    assert (decision.target, decision.kind) == (3, "up")
    assert "waiting_per_replica 5 vs target 2" in decision.reason
    assert decision.signals["waiting_per_replica"]["replicas"] == 5


def test_holds_during_stabilisation_when_one_sample_was_calm():
    samples = series(*[BUSY] * 3, QUIET, *[BUSY] * 3)
    assert not run(samples).changes


def test_holds_until_the_series_reaches_back_over_the_window():
    assert not run(series(*[BUSY] * 4)).changes  # 15 s of history after a restart of the autoscaler


def test_step_limits_how_far_one_change_goes():
    assert run(series(*[BUSY] * 7), scale_up=Step(2, 30)).target == 4  # asks for 5, max is 4
    assert run(series(*[BUSY] * 7), scale_up=Step(1, 30)).target == 3


def test_never_above_max_nor_below_min():
    assert not run(series(*[BUSY] * 7), current=4).changes
    down = run(series(*[IDLE] * 30, replicas=1), current=1)
    assert not down.changes  # min_replicas 1
    assert run(series(*[BUSY] * 7), current=6).target == 4  # above max: back to it at once
    assert run(series(*[IDLE] * 2), current=0, minimum=2).target == 2


def test_cooldown_blocks_the_next_change():
    assert not run(series(*[BUSY] * 7), last=NOW - 10).changes
    assert run(series(*[BUSY] * 7), last=NOW - 31).target == 3


def test_waits_for_replicas_it_asked_for_before_asking_again():
    samples = series(*[BUSY] * 7, replicas=3, ready=2)
    assert not run(samples, current=3).changes


def test_scales_down_only_after_the_longer_window_of_low_load():
    assert not run(series(*[QUIET] * 20)).changes  # 95 s < 120 s
    decision = run(series(*[QUIET] * 25))
    assert (decision.target, decision.kind) == (1, "down")
    assert not run(series(*[QUIET] * 24, BUSY)).changes  # the window's highest recommendation wins


def test_burn_rate_scales_up_when_the_slo_burns_and_down_when_it_has_stopped():
    burning = series(*[{**QUIET, "burn": 14.4}] * 7)
    decision = run(burning, signals={"burn_rate": 2.0})
    assert (decision.target, decision.kind) == (3, "up") and "burn_rate 14.4 vs target 2" in decision.reason
    assert not run(series(*[{**QUIET, "burn": 1.5}] * 30), signals={"burn_rate": 2.0}).changes  # hysteresis
    assert run(series(*[{**QUIET, "burn": 0.2}] * 30), signals={"burn_rate": 2.0}).kind == "down"


def test_ttft_headroom_against_the_slo_threshold():
    # Every request's TTFT in the 0.5-1.0 s bucket: p95 ~0.97 s against a 1000 ms target at 0.8 headroom.
    slow = {**QUIET, "ttft_buckets": {"0.5": 0, "1.0": 10, "+Inf": 10}}
    samples = series(*[slow] * 7)
    decision = run(samples, signals={"ttft_p95_headroom": 0.8}, targets=Targets(ttft_ms=1000))
    assert decision.kind == "up"
    assert decision.signals["ttft_p95_headroom"]["value"] == pytest.approx(0.975 / 0.8 * 0.8, rel=0.01)
    # Without an SLO threshold the signal cannot tell: nothing changes.
    assert not run(samples, signals={"ttft_p95_headroom": 0.8}).changes


def test_goodput_headroom_uses_the_measured_capacity_per_replica():
    samples = series(*[{**QUIET, "rps": 9.0}] * 7)  # 9 req/s on 2 replicas of 3 req/s each
    decision = run(samples, signals={"goodput_headroom": 0.75}, targets=Targets(capacity_rps=3.0))
    assert decision.signals["goodput_headroom"]["replicas"] == 4  # 9 / (3 × 0.75)
    assert decision.target == 3  # one step
    assert not run(samples, signals={"goodput_headroom": 0.75}).changes  # no curve: no opinion


def test_parks_after_idling_for_park_after_s_and_only_with_min_zero():
    samples = series(*[IDLE] * 61, replicas=1)  # 300 s
    decision = run(samples, current=1, minimum=0)
    assert (decision.target, decision.kind) == (0, "park")
    assert not run(samples, current=1, minimum=1).changes
    assert not run(series(*[IDLE] * 60, QUIET, replicas=1), current=1, minimum=0).changes
    assert run(series(*[IDLE] * 61, replicas=1), current=1, minimum=0, boost=1).kind != "park"


def test_a_woken_deployment_is_not_parked_again_before_it_has_served_park_after_s():
    parked_then_woken = series(*[IDLE] * 60, replicas=0, ready=0) + series(IDLE, replicas=1)[-1:]
    assert not run(parked_then_woken, current=1, minimum=0).changes  # the parked samples prove nothing
    idle_since_wake = series(*[IDLE] * 61, replicas=1)
    assert not run(idle_since_wake, current=1, minimum=0, last=NOW - 100).changes  # woken 100 s ago
    assert run(idle_since_wake, current=1, minimum=0, last=NOW - 300).kind == "park"


def test_normal_scale_down_never_parks():
    decision = run(series(*[IDLE] * 25), current=2, minimum=0)
    assert (decision.target, decision.kind) == (1, "down")


def test_a_held_request_wakes_a_parked_deployment_at_once():
    samples = series(*[IDLE] * 2, replicas=0, ready=0, held_last=True)
    decision = run(samples, current=0, minimum=0, last=NOW - 1)  # cooldown does not delay a wake
    assert (decision.target, decision.kind) == (1, "wake")
    assert not run(series(*[IDLE] * 2, replicas=0, ready=0), current=0, minimum=0).changes
    samples_held_idle = series(*[IDLE] * 61, replicas=1, held_last=True)
    assert not run(samples_held_idle, current=1, minimum=0).changes  # a held request is not idle


def test_a_degradation_boost_raises_the_floor_within_max():
    decision = run(series(*[QUIET] * 2), current=1, boost=2)
    assert (decision.target, decision.kind) == (3, "bound") and "degradation asks for 2 more" in decision.reason
    assert run(series(*[QUIET] * 2), current=1, boost=9).target == 4
    assert not run(series(*[QUIET] * 30), current=3, boost=2).changes  # held while in force
    assert run(series(*[QUIET] * 30), current=3, boost=0).kind == "down"


def test_quantile_interpolates_inside_the_bucket():
    assert quantile(0.5, {"1": 0, "2": 10, "+Inf": 10}) == pytest.approx(1.5)
    assert quantile(0.95, {}) is None
    assert quantile(0.95, {"1": 0, "+Inf": 4}) == 1.0  # in +Inf: the highest finite bound


def test_a_recorded_load_step_scales_up_once_the_window_is_overloaded_and_holds_before():
    """A series the autoscaler sampled from a real replica (bench/capacity/load_step.py): one client, then a
    step to 16 on a replica that runs 4 at once. Replayed tick by tick with the default policy, as the bench
    ran it: every tick holds until the 30 s window holds nothing but queued samples, then it asks for one more."""
    recorded = json.loads((Path(__file__).parents[1] / "fixtures" / "autoscaling" / "load-step-tiny.json").read_text())
    samples = [Sample.from_json(s) for s in recorded["samples"]]
    default = Policy(minimum=1, maximum=2, signals={"waiting_per_replica": 2.0, "kv_usage": 0.85})
    decisions = [decide(policy=default, samples=samples[: i + 1], current=1, last_change_at=None, now=sample.at)
                 for i, sample in enumerate(samples)]
    changed = [(round(samples[i].at - recorded["step_at"], 1), d.kind, d.target) for i, d in enumerate(decisions)
               if d.changes]
    assert changed[0][1:] == ("up", 2)
    assert 25 <= changed[0][0] <= 35 and abs(changed[0][0] - recorded["decided_after_s"]) < 1
    assert decisions[-1].signals["waiting_per_replica"] == {"value": 12.0, "target": 2.0, "replicas": 6}
    # With the window at 0 the first queued sample decides (and the step limits it to one more).
    eager = Policy(minimum=1, maximum=2, signals=default.signals, scale_up=Step(1, 0))
    first = next(i for i, s in enumerate(samples) if s.waiting)
    assert decide(policy=eager, samples=samples[: first + 1], current=1, last_change_at=None,
                  now=samples[first].at).target == 2
