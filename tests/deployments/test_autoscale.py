"""Autoscaling decisions, worked by hand: thresholds, windows, cooldowns, bounds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from deployments.replicas.autoscale import MinuteLoad, Policy, decide

NOW = datetime(2026, 11, 30, 12, 10, 30, tzinfo=UTC)
LAST_COMPLETE = datetime(2026, 11, 30, 12, 9, tzinfo=UTC)


def minutes(*loads):
    """Newest last: loads[-1] is the last complete minute."""
    count = len(loads)
    return [MinuteLoad(LAST_COMPLETE - timedelta(minutes=count - 1 - i), waiting, kv)
            for i, (waiting, kv) in enumerate(loads)]


def run(current=2, minimum=1, maximum=4, loads=(), last=None, boost=0):
    return decide(current=current, minimum=minimum, maximum=maximum, minutes=minutes(*loads),
                  last_scaled_at=last, now=NOW, policy=Policy(), boost=boost)


def test_scales_up_when_every_minute_of_the_window_is_queued():
    target, reason = run(loads=[(3.0, 0.5), (2.5, 0.5)])
    assert target == 3 and "queue" in reason


def test_kv_pressure_alone_scales_up():
    assert run(loads=[(0.0, 0.9), (0.0, 0.95)])[0] == 3


def test_one_busy_minute_is_not_enough():
    assert run(loads=[(0.5, 0.5), (5.0, 0.5)]) == (2, "")


def test_missing_minutes_mean_no_decision():
    assert run(loads=[(5.0, 0.9)]) == (2, "")


def test_cooldown_blocks_a_second_step():
    assert run(loads=[(3.0, 0.5), (3.0, 0.5)], last=NOW - timedelta(seconds=30)) == (2, "")
    assert run(loads=[(3.0, 0.5), (3.0, 0.5)], last=NOW - timedelta(seconds=61))[0] == 3


def test_never_above_max_or_below_min():
    assert run(current=4, loads=[(9.0, 0.99)] * 2) == (4, "")
    assert run(current=1, loads=[(0.0, 0.0)] * 5) == (1, "")
    assert run(current=6, maximum=4)[0] == 4
    assert run(current=0, minimum=1)[0] == 1


def test_a_degradation_boost_raises_the_floor_within_max_and_idle_scales_back_after_it():
    target, reason = run(current=1, minimum=1, maximum=4, boost=2)
    assert target == 3 and "degradation asks for 2 more" in reason
    assert run(current=1, minimum=1, maximum=2, boost=5)[0] == 2  # never above max_replicas
    idle = [(0.0, 0.1)] * 5
    assert run(current=3, minimum=1, maximum=4, boost=2, loads=idle) == (3, "")  # held while in force
    assert run(current=3, minimum=1, maximum=4, boost=0, loads=idle)[0] == 2  # and released after


def test_scales_down_only_after_the_longer_idle_window():
    assert run(loads=[(0.0, 0.1)] * 4) == (2, "")
    target, reason = run(loads=[(0.0, 0.1)] * 5)
    assert target == 1 and "idle" in reason
    assert run(loads=[(0.0, 0.1)] * 4 + [(0.0, 0.4)]) == (2, "")
    assert run(loads=[(0.0, 0.1)] * 5, last=NOW - timedelta(minutes=4)) == (2, "")


@pytest.mark.parametrize("waiting", [2.0, 1.0])
def test_threshold_is_strict(waiting):
    assert run(loads=[(waiting, 0.5)] * 2) == (2, "")


@pytest.mark.django_db
def test_autoscale_reads_minute_rows_and_records_the_change(make_user, tiny_llama_dir):
    from deployments.models import Deployment, Replica, ReplicaMetricsMinute
    from deployments.replicas.autoscale import autoscale
    from inferops.models import AuditEvent
    from registry import services

    actor = make_user("operator")
    model = services.model_create(name="tiny", task="generate", actor=actor)
    version = services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    deployment = Deployment.objects.create(name="auto", model=model, version=version, replicas=2,
                                           min_replicas=1, max_replicas=3, autoscale=True)
    replicas = [Replica.objects.create(deployment=deployment, version=version, node="n", state="ready")
                for _ in range(2)]
    for minute in (LAST_COMPLETE - timedelta(minutes=1), LAST_COMPLETE):
        for replica, waiting in zip(replicas, (5.0, 1.0), strict=True):  # 3 waiting per replica
            ReplicaMetricsMinute.objects.create(replica=replica, deployment=deployment, version=version,
                                                start=minute, waiting_avg=waiting, kv_cache_usage_avg=0.5)
    assert "queue" in autoscale(deployment, NOW)
    deployment.refresh_from_db()
    assert deployment.replicas == 3 and deployment.last_scaled_at == NOW
    event = AuditEvent.objects.get(action="deployment.autoscale")
    assert event.before == {"replicas": 2} and event.after["replicas"] == 3
    assert autoscale(deployment, NOW + timedelta(seconds=5)) == ""  # at max and in cooldown
