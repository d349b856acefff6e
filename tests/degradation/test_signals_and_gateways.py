"""The engine and the rest of the platform: it gets its burn rates from the evaluation cycle (no query
of its own), publishes each level change and the TTFT deadlines to the gateways at once, heals a
lost publish, and counts the gateways' early TTFT verdicts, which see an overload in flight."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from degradation import engine, gateway, services
from degradation.models import DegradationState
from inferops.redis_client import redis_client
from runtime.gateway.contract import (
    DEGRADATION_KEY,
    TTFT_VERDICTS_PREFIX,
    ttft_verdict_field,
    ttft_verdicts_key,
)
from slo import signals
from slo.services import slo_create
from slo.tasks import evaluation_cycle
from tests.degradation.conftest import LEVELS
from tests.slo.conftest import NOW


@pytest.fixture
def redis():
    client = redis_client()

    def clean():
        client.delete(DEGRADATION_KEY)
        for name in client.scan_iter(f"{TTFT_VERDICTS_PREFIX}:*"):
            client.delete(name)

    clean()
    yield client
    clean()


@pytest.fixture
def watched(deployment):
    slo = slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", min_requests=10)
    return deployment, slo


def published(redis, name: str = "chat") -> dict | None:
    raw = redis.hget(DEGRADATION_KEY, name)
    return json.loads(raw) if raw else None


def test_the_cycle_hands_the_policy_window_burn_to_the_engine_which_queries_none(watched, add_events, monkeypatch,
                                                                                 redis):
    deployment, slo = watched
    services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=7, hold_s=60, slos=[],
                         levels=LEVELS)
    add_events(NOW, good=20, ttft_ms=100.0)
    add_events(NOW, good=20, ttft_ms=400.0)
    seen = []

    def listener(sender, now, evaluations, **kwargs):
        seen.append(evaluations[slo.pk].window_burns)

    signals.cycle_evaluated.connect(listener)
    monkeypatch.setattr(engine, "running_totals_at", lambda probes: pytest.fail("the engine queried the SLIs"))
    try:
        evaluation_cycle(now=NOW)
    finally:
        signals.cycle_evaluated.disconnect(listener)
    assert seen == [{7: (pytest.approx(50.0), 40)}]  # the policy's 7-minute window, computed by the cycle
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 1 and state.burn_rates == {"chat-ttft": pytest.approx(50.0)}


def test_levels_and_deadlines_reach_redis_as_they_commit_and_a_lost_publish_heals(
        watched, add_events, redis, django_capture_on_commit_callbacks):
    deployment, _ = watched
    with django_capture_on_commit_callbacks(execute=True):
        services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60,
                             slos=[], levels=LEVELS)
    entry = published(redis)
    assert entry["degradation"] is None and entry["ttft_deadlines_ms"] == [150.0]

    add_events(NOW, good=40, ttft_ms=900.0)
    with django_capture_on_commit_callbacks(execute=True):
        evaluation_cycle(now=NOW)
    entry = published(redis)
    assert entry["degradation"] == {"level": 1, "name": "shed-batch", "shed_below_priority": 5,
                                    "max_tokens_cap": None, "fallback": None, "retry_after_s": 60}
    assert entry["published_at"] == pytest.approx(time.time(), abs=60)

    redis.delete(DEGRADATION_KEY)  # lost (Redis flushed, or down when the level moved)
    with django_capture_on_commit_callbacks(execute=True):
        evaluation_cycle(now=NOW + timedelta(seconds=5))  # held: no move, but the entry is put back
    assert published(redis)["degradation"]["level"] == 1

    with django_capture_on_commit_callbacks(execute=True):
        services.policy_save(deployment=deployment, actor=None, enabled=False, window_minutes=5, hold_s=60,
                             slos=[], levels=LEVELS)
    assert published(redis) == {"degradation": None, "ttft_deadlines_ms": [], "published_at": pytest.approx(
        time.time(), abs=60)}


def count_verdicts(redis, deadline_ms: float, good: int, bad: int, at: float) -> None:
    minute, second = divmod(int(at), 60)
    key = ttft_verdicts_key("chat", minute)
    redis.hincrby(key, ttft_verdict_field(deadline_ms, second, True), good)
    redis.hincrby(key, ttft_verdict_field(deadline_ms, second, False), bad)


def test_early_verdicts_raise_the_level_before_any_request_has_ended(watched, redis):
    deployment, slo = watched
    services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=1, hold_s=60, slos=[],
                         levels=LEVELS)
    now = timezone.now()
    # Requests in flight past their 150 ms deadline, counted by a gateway; no usage event yet.
    count_verdicts(redis, 150, good=10, bad=2, at=now.timestamp() - 30)  # before the 10 s early window
    count_verdicts(redis, 400, good=0, bad=50, at=now.timestamp() - 2)  # another SLO's deadline
    count_verdicts(redis, 150, good=5, bad=4, at=now.timestamp() - 2)  # 9 < min_requests (10)
    evaluation_cycle(now=now)
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 0 and state.burn_rates == {}

    count_verdicts(redis, 150, good=0, bad=1, at=now.timestamp() - 1)
    evaluation_cycle(now=now + timedelta(milliseconds=10))
    state.refresh_from_db()
    # 5 of 10 late: the early burn is 0.5 / 0.01 = 50, the exact one not measured yet.
    assert state.level == 1 and state.burn_rates == {"chat-ttft": pytest.approx(50.0)}


def test_the_early_burn_counts_only_what_a_gateway_can_judge_for_the_slo(deployment):
    def slo(**fields):
        defaults = dict(actor=None, deployment=deployment, sli_kind="latency", ttft_ms=150, objective=0.99,
                        window="1d")
        return slo_create(**{**defaults, **fields})

    assert gateway.early_judged(slo(name="ttft"))
    assert gateway.early_judged(slo(name="goodput", sli_kind="goodput"))
    assert not gateway.early_judged(slo(name="e2e", ttft_ms=None, e2e_ms=900))
    assert not gateway.early_judged(slo(name="tenant", scope="tenant", tenant="acme"))
    assert not gateway.early_judged(slo(name="slices", budgeting="timeslices", timeslice_target=0.9))
    window = gateway.EarlyWindow(now=600.5, seconds=10)
    assert list(window.minutes()) == [9, 10] and window.holds(9, 50) and window.holds(10, 0)
    assert not window.holds(9, 49) and not window.holds(10, 1)  # buckets of a second that overlap it
