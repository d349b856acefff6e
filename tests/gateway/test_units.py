"""The gateway's pure parts: SSE observation, token estimates, replica choice."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from runtime.gateway.limits import estimate_prompt_tokens
from runtime.gateway.proxy import StreamObserver, read_usage
from runtime.gateway.router import NoReplica, Router, Saturated, _rendezvous_score, affinity_key
from runtime.gateway.state import ApiKey, Replica, Route, Version

# Responses recorded from a real vLLM server; see the README next to them.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32-cpu"


def _route(*versions: tuple[int, int, int]) -> Route:
    """versions: (number, weight, replica count); replica ids are number * 10 + i."""
    return Route("d", "generate", tuple(
        Version(number, weight, tuple(Replica(number * 10 + i, f"http://r{number}-{i}") for i in range(count)))
        for number, weight, count in versions))


def test_observer_reads_a_recorded_vllm_stream_split_anywhere_and_strips_the_usage_chunk():
    raw = (FIXTURES / "chat-stream.sse").read_bytes()
    for split_every in (1, 7, 64, len(raw)):
        observer = StreamObserver(strip_usage=True)
        out = b"".join(observer.feed(raw[i:i + split_every], float(i)) for i in range(0, len(raw), split_every))
        out += observer.leftover()
        assert observer.usage == {"prompt_tokens": 11, "total_tokens": 17, "completion_tokens": 6}
        assert observer.finish_reason == "length"
        # The first event counts when its end arrives (the feed that brought its last byte).
        first_event_end = raw.index(b"\n\n") + 1
        assert first_event_end - split_every < observer.first_chunk_at <= first_event_end
        assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
        # Everything else passes byte for byte.
        usage_event = [e for e in raw.split(b"\n\n") if b'"usage":{' in e][0]
        assert out == raw.replace(usage_event + b"\n\n", b"")


def test_observer_keeps_the_usage_chunk_when_the_client_asked_for_it():
    raw = (FIXTURES / "chat-stream.sse").read_bytes()
    observer = StreamObserver(strip_usage=False)
    assert observer.feed(raw, 1.0) + observer.leftover() == raw
    assert observer.content_chunks == 7  # role chunk + 6 tokens, not the usage chunk


def test_observer_notes_a_mid_stream_error_event():
    observer = StreamObserver(strip_usage=True)
    observer.feed(b'data: {"error":{"message":"stopped","code":503}}\n\ndata: [DONE]\n\n', 1.0)
    assert observer.saw_error and observer.first_chunk_at is None


def test_read_usage_of_a_recorded_completion():
    usage, finish = read_usage((FIXTURES / "completion.json").read_bytes())
    assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 5 and finish == "length"
    assert read_usage(b"not json") == (None, None)


@pytest.mark.parametrize(("body", "expected"), [
    ({"prompt": "a" * 9}, 3),
    ({"prompt": [1, 2, 3, 4, 5]}, 5),
    ({"prompt": [[1, 2], [3]]}, 3),
    ({"prompt": ["abcd", "abcde"]}, 3),
    ({"messages": [{"role": "system", "content": "x" * 8}, {"role": "user", "content": "y"}]}, 3),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 12}]}]}, 3),
    ({"input": "abcdefgh"}, 2),
    ({}, 0),
])
def test_prompt_token_estimate(body, expected):
    assert estimate_prompt_tokens(body) == expected


def test_key_scope_and_expiry():
    key = ApiKey.from_json({"prefix": "abcd1234", "tenant": "acme", "deployments": ["a"], "expires_at": 100.0,
                            "limits": {"key": {"rpm": 5}, "tenant": None}})
    assert key.may_use("a") and not key.may_use("b")
    assert key.may_use("a--preview") and not key.may_use("b--preview")  # a rollout's preview route of `a`
    assert key.expired(100.0) and not key.expired(99.9)
    assert key.key_limits.rpm == 5 and key.tenant_limits.unlimited
    assert ApiKey.from_json({"prefix": "p", "tenant": "t", "deployments": []}).may_use("anything")


def test_versions_follow_weights_and_weight_zero_gets_nothing():
    router = Router()
    route = _route((1, 90, 1), (2, 10, 1), (3, 0, 1))
    counts = Counter(router.choose(route, "", set()).version for _ in range(2000))
    assert counts[3] == 0
    assert 1650 < counts[1] < 1950


def test_least_outstanding_wins_without_affinity():
    router = Router()
    route = _route((1, 100, 3))
    replicas = route.versions[0].replicas
    for _ in range(2):
        router.started(replicas[0])
    router.started(replicas[1])
    assert router.choose(route, "", set()).replica == replicas[2]


def test_affinity_prefers_one_replica_within_the_slack_then_spills():
    router = Router(affinity_slack=2)
    route = _route((1, 100, 4))
    body = {"messages": [{"role": "system", "content": "You are a helpful assistant. " * 20}]}
    prefix = affinity_key(body)
    assert len(prefix) == 256
    preferred = max(route.versions[0].replicas, key=lambda r: _rendezvous_score(prefix, r))
    for _ in range(3):
        assert router.choose(route, prefix, set()).replica == preferred
        router.started(preferred)
    # Now 3 outstanding on the preferred one against 0 elsewhere: beyond the slack of 2.
    assert router.choose(route, prefix, set()).replica != preferred


def test_saturated_replicas_shed_and_no_replica_is_distinct():
    router = Router(max_outstanding_per_replica=1)
    route = _route((1, 100, 2))
    for replica in route.versions[0].replicas:
        router.started(replica)
    with pytest.raises(Saturated):
        router.choose(route, "", set())
    with pytest.raises(NoReplica):
        router.choose(route, "", {"http://r1-0", "http://r1-1"})
    with pytest.raises(NoReplica):
        router.choose(_route((1, 0, 2)), "", set())


def test_repeated_failures_eject_a_replica_for_a_cool_off(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("runtime.gateway.router.time.monotonic", lambda: clock[0])
    router = Router(failure_threshold=3, failure_window_s=10, ejection_s=15)
    route = _route((1, 100, 2))
    bad, good = route.versions[0].replicas
    assert not router.record_failure(bad)
    clock[0] += 11  # the first failure falls out of the window
    assert not router.record_failure(bad)
    assert not router.record_failure(bad)
    assert router.record_failure(bad)
    assert {router.choose(route, str(i), set()).replica for i in range(50)} == {good}
    # Every candidate ejected: try them anyway rather than answer 503 for sure.
    assert router.choose(route, "", {good.url}).replica == bad
    clock[0] += 15
    assert {router.choose(route, str(i), set()).replica for i in range(50)} == {bad, good}


def test_error_fixture_shape_matches_ours():
    from runtime.gateway.server import GatewayError

    recorded = json.loads((FIXTURES / "error-unknown-model.json").read_text())
    ours = json.loads(GatewayError(404, "x", "NotFoundError", "not_found", "model").body)
    assert set(ours["error"]) == set(recorded["error"]) and ours["error"]["code"] == recorded["error"]["code"]


class _RedisMinutesBehind:
    """A Redis whose clock (TIME) is five minutes behind this host's: a gateway 5 min ahead sees that."""

    async def time(self) -> tuple[int, int]:
        at = time.time() - 300
        return int(at), int(at % 1 * 1_000_000)


def test_a_gateway_minutes_ahead_dates_its_usage_and_heartbeat_by_redis_clock(monkeypatch):
    """Chaos suite, clock_skew: usage events carried the gateway host's time, so a host 5 min ahead put
    usage 5 min in the ledger's future."""
    from runtime.gateway import clock, heartbeat
    from runtime.gateway.server import RequestRecord

    monkeypatch.setattr(clock, "offset_s", 0.0)
    asyncio.run(clock.sync(_RedisMinutesBehind()))
    assert clock.offset_s == pytest.approx(-300, abs=0.5)
    assert RequestRecord("chat").started_at == pytest.approx(time.time() - 300, abs=0.5)
    entry = json.loads(heartbeat.gateway_entry("gw", "10.0.0.1:8080"))
    assert entry["seen_at"] == pytest.approx(time.time() - 300, abs=0.5)
