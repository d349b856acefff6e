"""Scale from zero: the gateway holds requests for a parked deployment until a replica is ready,
within the route's limits, and tells the control plane it wants one (real Redis, fake replicas)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from runtime.gateway.contract import (
    ACTIVATION_CHANNEL,
    ACTIVATION_KEY,
    ROUTING_CHANNEL,
    ROUTING_GENERATION_KEY,
    ROUTING_KEY,
)
from runtime.gateway.server import Gateway, GatewayServer, GatewaySettings
from runtime.gateway.state import Route, ScaleFromZero
from tests.gateway.conftest import REDIS_URL, Control, ThreadedServer
from tests.gateway.test_resilience import RedisProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HTTP = httpx.Client(timeout=30)
COLD_START = "from zero (cold start)"


@pytest.fixture(autouse=True)
def empty_redis():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield
    client.flushdb()
    client.close()


def publish_parked(control: Control, name: str = "demo", replicas: list | None = None, *,
                   max_wait_s: float = 10.0, max_queue: int = 10, scale_from_zero: bool = True) -> None:
    """The routing entry of a deployment that may park, as deployments/replicas/routing.py writes it:
    no replica while parked; `replicas` [(id, url)] once one is ready."""
    entry = {"deployment": name, "model": name, "task": "generate", "backend": "builtin",
             "versions": [{"version": 1, "track": "stable", "weight": 100,
                           "replicas": [{"id": rid, "url": url} for rid, url in replicas]}] if replicas else [],
             "published_at": time.time(), "degradation": None,
             "scale_from_zero": {"max_wait_s": max_wait_s, "max_queue": max_queue} if scale_from_zero else None}
    control.redis.hset(ROUTING_KEY, name, json.dumps(entry))
    control.redis.incr(ROUTING_GENERATION_KEY)
    control.redis.publish(ROUTING_CHANNEL, name)


def chat(model: str = "demo", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def post(base_url: str, secret: str, body: dict, client: httpx.Client = HTTP) -> httpx.Response:
    return client.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"})


def metric(base_url: str, name: str, **labels: str) -> float:
    text = HTTP.get(base_url.removesuffix("/v1") + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def held_now(base_url: str) -> float:
    return metric(base_url, "inferops_gateway_held_requests", deployment="demo")


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


def test_old_and_null_entries_do_not_hold_and_limits_default():
    entry = {"deployment": "demo", "versions": []}
    assert Route.from_json(entry).scale_from_zero is None
    assert Route.from_json({**entry, "scale_from_zero": None}).scale_from_zero is None
    assert Route.from_json({**entry, "scale_from_zero": {}}).scale_from_zero == ScaleFromZero(120.0, 100)
    parked = Route.from_json({**entry, "scale_from_zero": {"max_wait_s": 2, "max_queue": 3}})
    assert parked.scale_from_zero == ScaleFromZero(2.0, 3) and not parked.has_ready_replica


def test_held_requests_streamed_or_not_are_answered_once_a_replica_is_ready(control, replicas, gateways, pool):
    (replica,) = replicas(1)
    publish_parked(control)
    secret, _ = control.publish_key("acme")
    gateway, base_url = gateways()
    listener = control.redis.pubsub()
    listener.subscribe(ACTIVATION_CHANNEL)

    whole = pool.submit(post, base_url, secret, chat())
    streamed = pool.submit(post, base_url, secret, chat(stream=True))
    wait_until(lambda: held_now(base_url) == 2, "two held requests", timeout=10)
    wanted = wait_until(lambda: control.redis.hget(ACTIVATION_KEY, "demo"), "the activation request", timeout=10)
    activation = json.loads(wanted)
    assert activation["gateway"] == "test-0" and activation["held"] in (1, 2)
    assert abs(activation["at"] - time.time()) < 5
    message = wait_until(lambda: listener.get_message(ignore_subscribe_messages=True, timeout=0.1),
                         "the activation message", timeout=10)
    assert message["data"] == b"demo"
    # The control plane deletes the field once it acted; one lost meanwhile is asked for again.
    control.redis.hdel(ACTIVATION_KEY, "demo")
    wait_until(lambda: control.redis.hexists(ACTIVATION_KEY, "demo"), "the activation asked for again", timeout=10)
    assert not whole.done() and not streamed.done()

    publish_parked(control, replicas=[(replica.id, replica.url)])
    published = time.monotonic()
    answered, stream = whole.result(timeout=20), streamed.result(timeout=20)
    assert time.monotonic() - published < 5  # released by the routing change, not by a timeout
    assert answered.status_code == 200
    assert answered.json()["choices"][0]["message"]["content"] == "Hello world"
    assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    assert '"content":"Hel"' in stream.text
    assert len(replica.bodies) == 2
    assert held_now(base_url) == 0
    assert metric(base_url, "inferops_gateway_hold_seconds_count", deployment="demo", outcome="released") == 2

    events = control.wait_events(2)
    assert all(e["status"] == 200 and e["error_kind"] is None and e["held_ms"] > 0 for e in events)
    streamed_event = next(e for e in events if e["stream"])
    assert streamed_event["ttft_ms"] >= streamed_event["held_ms"]  # timed from the request's arrival
    # Nothing held: no held_ms.
    assert post(base_url, secret, chat()).status_code == 200
    assert control.wait_events(3)[-1]["held_ms"] is None
    listener.close()


def test_a_full_hold_queue_refuses_at_once_with_retry_after(control, replicas, gateways, pool):
    (replica,) = replicas(1)
    publish_parked(control, max_queue=1)
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    first = pool.submit(post, base_url, secret, chat())
    wait_until(lambda: held_now(base_url) == 1, "one held request", timeout=10)

    started = time.monotonic()
    refused = post(base_url, secret, chat())
    assert time.monotonic() - started < 3
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    error = refused.json()["error"]
    assert COLD_START in error["message"] and "refused without waiting" in error["message"]
    assert error["type"] == "ServiceUnavailableError"
    assert metric(base_url, "inferops_gateway_shed_total", deployment="demo", reason="hold_full") == 1

    publish_parked(control, max_queue=1, replicas=[(replica.id, replica.url)])
    assert first.result(timeout=20).status_code == 200
    events = control.wait_events(2)
    shed = next(e for e in events if e["status"] == 503)
    assert shed["error_kind"] == "shed" and 0 <= shed["held_ms"] < 100
    assert metric(base_url, "inferops_gateway_hold_seconds_count", deployment="demo", outcome="full") == 1


def test_a_hold_that_outlasts_max_wait_answers_503_saying_so(control, gateways):
    publish_parked(control, max_wait_s=1)
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    started = time.monotonic()
    refused = post(base_url, secret, chat(stream=True))
    waited = time.monotonic() - started
    assert 0.9 < waited < 10
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    message = refused.json()["error"]["message"]
    assert COLD_START in message and "no replica was ready after 1." in message and "Retry" in message
    assert metric(base_url, "inferops_gateway_shed_total", deployment="demo", reason="hold_timeout") == 1
    assert metric(base_url, "inferops_gateway_hold_seconds_count", deployment="demo", outcome="timeout") == 1
    assert held_now(base_url) == 0
    (event,) = control.wait_events(1)
    assert (event["status"], event["error_kind"], event["replica"]) == (503, "shed", None)
    assert event["held_ms"] >= 900
    assert control.redis.hexists(ACTIVATION_KEY, "demo")  # the control plane still starts one


def test_a_client_that_leaves_while_held_frees_its_slot(control, replicas, gateways, pool):
    (replica,) = replicas(1)
    publish_parked(control, max_queue=1, max_wait_s=20)
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    impatient = httpx.Client(timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):
        post(base_url, secret, chat(), client=impatient)
    impatient.close()  # the connection closes: the gateway sees the client leave
    wait_until(lambda: held_now(base_url) == 0, "the slot freed", timeout=10)
    assert metric(base_url, "inferops_gateway_hold_seconds_count", deployment="demo", outcome="gone") == 1
    (left,) = control.wait_events(1)
    assert (left["status"], left["error_kind"]) == (499, "client_disconnect") and left["held_ms"] > 0

    waiting = pool.submit(post, base_url, secret, chat())  # the freed slot takes another request
    wait_until(lambda: held_now(base_url) == 1, "the next request held", timeout=10)
    publish_parked(control, max_queue=1, replicas=[(replica.id, replica.url)])
    assert waiting.result(timeout=20).status_code == 200
    assert len(replica.bodies) == 1


def test_a_gateway_shutting_down_answers_its_held_requests_at_once(control, tmp_path, pool):
    publish_parked(control, max_wait_s=30)
    secret, _ = control.publish_key("acme")
    gateway = Gateway(GatewaySettings(redis_url=REDIS_URL, instance="draining", spool_dir=tmp_path / "spool"))
    server = ThreadedServer(gateway)
    server.server = GatewayServer(server.server.config, gateway)  # as `inferops gateway` runs it
    server.thread = threading.Thread(target=server.server.run, daemon=True)
    base_url = f"{server.start().url}/v1"
    held = [pool.submit(post, base_url, secret, chat()), pool.submit(post, base_url, secret, chat(stream=True))]
    wait_until(lambda: held_now(base_url) == 2, "two held requests", timeout=10)
    wait_until(lambda: control.redis.hexists(ACTIVATION_KEY, "demo"), "the activation request", timeout=10)

    stopping = threading.Thread(target=server.stop)
    stopping.start()
    # Without the early answer uvicorn would drop them after its graceful timeout instead.
    for answer in (future.result(timeout=10) for future in held):
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        message = answer.json()["error"]["message"]
        assert "This gateway is shutting down" in message and COLD_START in message
        assert "another gateway instance or this one after restart will serve it" in message
    stopping.join(15)
    assert not stopping.is_alive()
    events = control.wait_events(2)
    assert [(e["status"], e["error_kind"]) for e in events] == [(503, "shed")] * 2
    assert control.redis.hexists(ACTIVATION_KEY, "demo")  # the replica still starts


def test_without_scale_from_zero_or_on_a_preview_route_no_replica_is_503_at_once(control, gateways):
    control.publish_route("old", [])  # an entry from before scale_from_zero existed
    publish_parked(control, "pinned", scale_from_zero=False)
    publish_parked(control, "demo--preview")  # a preview never holds, whatever its entry says
    secret, _ = control.publish_key("acme")
    _, base_url = gateways()
    for model in ("old", "pinned", "demo--preview"):
        started = time.monotonic()
        refused = post(base_url, secret, chat(model))
        assert time.monotonic() - started < 3
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert f"No ready replica serves `{model}`" in refused.json()["error"]["message"]
        assert metric(base_url, "inferops_gateway_shed_total", deployment=model, reason="no_replica") == 1
    assert control.redis.hlen(ACTIVATION_KEY) == 0
    assert all(e["held_ms"] is None for e in control.wait_events(3))


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_held_requests_wait_through_a_redis_outage(replicas, gateways, pool, tmp_path):
    private = RedisProcess(tmp_path)
    private.start()
    control = Control(private.url)
    try:
        (replica,) = replicas(1)
        publish_parked(control, max_wait_s=30)
        secret, _ = control.publish_key("acme")
        _, base_url = gateways(private.url)
        waiting = pool.submit(post, base_url, secret, chat())
        wait_until(lambda: held_now(base_url) == 1, "one held request", timeout=10)
        private.stop()
        wait_until(lambda: metric(base_url, "inferops_gateway_redis_up") == 0, "redis seen down", timeout=10)
        assert held_now(base_url) == 1 and not waiting.done()
        private.start()
        control = Control(private.url)
        publish_parked(control, max_wait_s=30, replicas=[(replica.id, replica.url)])
        assert waiting.result(timeout=20).status_code == 200
    finally:
        control.redis.close()
        private.stop()
