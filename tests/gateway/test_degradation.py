"""The gateway applies a deployment's degradation level from the routing table: sheds low
priorities with 503 `degraded`, caps max_tokens, sends traffic to a fallback deployment.
Fake replicas stand in for the engine (the proxy alone is under test); Redis is real."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from runtime.gateway.state import Degradation, Fallback, Route
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HTTP = httpx.Client(timeout=20)
# Gateways see a published table within a pub/sub hop, or their 1 s generation poll.
PUBLISHED = 5.0


def _post(base_url: str, secret: str, **body):
    return HTTP.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                     json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], **body})


def _level(**actions) -> dict:
    return {"level": 1, "name": "protect", "retry_after_s": 20, **actions}


def test_a_degraded_level_sheds_keys_below_its_priority_before_any_replica(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])],
                          degradation=_level(shed_below_priority=5))
    low, _ = control.publish_key("batch", priority=1)
    high, _ = control.publish_key("interactive", priority=9)
    _, base_url = gateways()

    shed = _post(base_url, low, max_tokens=4)
    assert shed.status_code == 503 and shed.headers["retry-after"] == "20"
    assert shed.headers["x-inferops-degradation-level"] == "1"
    error = shed.json()["error"]
    assert error["code"] == "degraded" and error["type"] == "ServiceUnavailableError"
    assert "below priority 5" in error["message"] and "level 1 protect" in error["message"]
    assert replica.bodies == []
    # A client cannot dodge the shed by asking for more priority than its key has.
    assert _post(base_url, low, max_tokens=4, priority=9).status_code == 503

    served = _post(base_url, high, max_tokens=4)
    assert served.status_code == 200 and served.headers["x-inferops-degradation-level"] == "1"
    assert [body["priority"] for body in replica.bodies] == [9]
    events = {event["tenant"]: event for event in control.wait_events(3)}
    assert events["batch"]["status"] == 503 and events["batch"]["error_kind"] == "degraded"
    assert events["interactive"]["status"] == 200 and events["interactive"]["error_kind"] is None

    # Back at level 0 (a null degradation) nothing is shed and no header is sent.
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])], degradation=None)
    wait_until(lambda: _post(base_url, low, max_tokens=4).status_code == 200, "level 0 at the gateway", PUBLISHED)
    assert "x-inferops-degradation-level" not in _post(base_url, low, max_tokens=4).headers


def test_max_tokens_above_the_cap_are_lowered_and_the_response_says_so(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])], degradation=_level(max_tokens_cap=16))
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()

    capped = _post(base_url, secret, max_tokens=500)
    assert capped.status_code == 200 and capped.headers["x-inferops-max-tokens-capped"] == "16"
    assert replica.bodies[-1]["max_tokens"] == 16
    below = _post(base_url, secret, max_tokens=8)
    assert "x-inferops-max-tokens-capped" not in below.headers and replica.bodies[-1]["max_tokens"] == 8
    unbounded = _post(base_url, secret)  # no limit asked: the cap is the limit
    assert unbounded.headers["x-inferops-max-tokens-capped"] == "16" and replica.bodies[-1]["max_tokens"] == 16
    newer = _post(base_url, secret, max_completion_tokens=1000, stream=True)
    assert newer.status_code == 200 and newer.headers["x-inferops-max-tokens-capped"] == "16"
    assert replica.bodies[-1]["max_completion_tokens"] == 16 and "max_tokens" not in replica.bodies[-1]


def test_a_fallback_takes_the_chosen_priorities_and_a_share_of_the_rest(control, replicas, gateways):
    primary, small = replicas(2)
    control.publish_route("small", [(1, 100, [(small.id, small.url)])])
    control.publish_route("demo", [(1, 100, [(primary.id, primary.url)])],
                          degradation=_level(fallback={"deployment": "small", "weight": 0, "priorities": [1]}))
    low, _ = control.publish_key("batch", ["demo"], priority=1)
    high, _ = control.publish_key("interactive", ["demo"], priority=9)
    _, base_url = gateways()

    moved = _post(base_url, low, max_tokens=4)
    assert moved.status_code == 200 and moved.headers["x-inferops-fallback"] == "small"
    assert small.bodies[-1]["model"] == "small" and moved.json()["model"] == "small"
    kept = _post(base_url, high, max_tokens=4)
    assert kept.status_code == 200 and "x-inferops-fallback" not in kept.headers and len(primary.bodies) == 1
    events = {event["tenant"]: event for event in control.wait_events(2)}
    assert events["batch"]["deployment"] == "small" and events["interactive"]["deployment"] == "demo"

    # weight 100: everything moves; a fallback without ready replicas moves nothing.
    control.publish_route("demo", [(1, 100, [(primary.id, primary.url)])],
                          degradation=_level(fallback={"deployment": "small", "weight": 100}))
    wait_until(lambda: _post(base_url, high, max_tokens=4).headers.get("x-inferops-fallback") == "small",
               "everything moved to the fallback", PUBLISHED)
    control.publish_route("small", [(1, 100, [])])
    wait_until(lambda: "x-inferops-fallback" not in _post(base_url, high, max_tokens=4).headers,
               "nothing moved to a fallback without replicas", PUBLISHED)
    assert len(primary.bodies) >= 2



def test_a_published_level_change_applies_at_once_and_a_later_routing_entry_wins_back(control, replicas,
                                                                                     gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])], degradation=None)
    low, _ = control.publish_key("batch", priority=1)
    _, base_url = gateways()
    assert _post(base_url, low, max_tokens=4).status_code == 200

    # The engine's publish: the routing table still says level 0 (no reconcile pass yet).
    control.publish_degradation("demo", _level(shed_below_priority=5))
    wait_until(lambda: _post(base_url, low, max_tokens=4).status_code == 503, "level 1 at the gateway", PUBLISHED)
    # The reconcile pass republishes the route later with the level in force: the same answer.
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])], degradation=_level(shed_below_priority=5))
    assert _post(base_url, low, max_tokens=4).status_code == 503
    # Back to 0 by the engine's publish, before any reconcile pass.
    control.publish_degradation("demo", None)
    wait_until(lambda: _post(base_url, low, max_tokens=4).status_code == 200, "level 0 at the gateway", PUBLISHED)
    # A publish lost while Redis was down is healed by the next routing entry: the later one counts.
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])], degradation=_level(shed_below_priority=5))
    wait_until(lambda: _post(base_url, low, max_tokens=4).status_code == 503, "the routing entry's level",
               PUBLISHED)


def test_streamed_requests_are_judged_at_the_first_token_or_when_the_deadline_passes(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_degradation("demo", None, ttft_deadlines_ms=[200, 5000])
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    wait_until(lambda: _post(base_url, secret, max_tokens=4, stream=True).status_code == 200,
               "the gateway to serve", PUBLISHED)
    wait_until(lambda: control.ttft_verdicts("demo") == {"200:good": 1, "5000:good": 1},
               lambda: f"a fast stream judged good against both deadlines ({control.ttft_verdicts('demo')})", 5)

    # A slow first token: late for 200 ms while the request is still in flight, not yet judged for 5 s.
    replica.behaviour.first_delay_s = 3
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(_post, base_url, secret, max_tokens=4, stream=True)
        wait_until(lambda: control.ttft_verdicts("demo").get("200:bad") == 1,
                   lambda: f"the 200 ms deadline counted as missed in flight ({control.ttft_verdicts('demo')})", 5)
        assert not slow.done() and "5000:bad" not in control.ttft_verdicts("demo")
        assert slow.result().status_code == 200
    wait_until(lambda: control.ttft_verdicts("demo") == {"200:good": 1, "200:bad": 1, "5000:good": 2},
               lambda: f"the slow stream judged good against 5 s ({control.ttft_verdicts('demo')})", 5)

    # Not streamed (its TTFT is the replica's, known at the end), or no deadlines: nothing counted.
    replica.behaviour.first_delay_s = 0
    assert _post(base_url, secret, max_tokens=4).status_code == 200
    control.publish_degradation("demo", None)
    wait_until(lambda: _post(base_url, secret, max_tokens=4, stream=True).status_code == 200
               and replica.completed == 5, "two more requests", PUBLISHED)
    assert sum(control.ttft_verdicts("demo").values()) == 4


def test_the_degradation_entry_parses_to_its_actions():
    assert Degradation.from_json(None) is None and Degradation.from_json({"level": 0}) is None
    route = Route.from_json({"deployment": "d", "versions": [], "degradation": {
        "level": 2, "name": "hard", "shed_below_priority": 3, "max_tokens_cap": None,
        "fallback": {"deployment": "small", "weight": 25, "priorities": [0, 1]}, "retry_after_s": 45}})
    assert route.degradation == Degradation(2, "hard", 3, None, Fallback("small", 25, frozenset({0, 1})), 45)
    fallback = route.degradation.fallback
    assert fallback.takes(0, 0.99) and not fallback.takes(5, 0.25) and fallback.takes(5, 0.2499)
