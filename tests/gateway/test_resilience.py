"""Redis stopped under a gateway: serving goes on from memory, usage events spool and replay.

Runs its own redis-server on a free port (append-only file on, like a production Redis, so a
restart keeps what was written before it); the shared test Redis is not touched.
"""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
import redis

from tests.conftest import free_port
from tests.gateway.conftest import Control
from tests.processes import stop_process
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]


class RedisProcess:
    def __init__(self, directory) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "yes",
                                      "--dir", str(self.directory), "--bind", "127.0.0.1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        wait_until(client.ping, f"redis-server on port {self.port} to answer", timeout=10,
                   ignore=(redis.ConnectionError,))
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@pytest.fixture
def private_redis(tmp_path):
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


def _metric(http: httpx.Client, base_url: str, name: str) -> float:
    for line in http.get(base_url.removesuffix("/v1") + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


def test_redis_stopped_serving_goes_on_and_every_usage_event_arrives_after_it_returns(
        private_redis, replicas, gateways, tmp_path):
    (replica,) = replicas(1)
    control = Control(private_redis.url)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    secret, _ = control.publish_key("acme", tenant_limits={"rpm": 1000, "tpm": 1_000_000})
    open_gateway, open_url = gateways(private_redis.url)
    _, closed_url = gateways(private_redis.url, redis_down_limits="closed")
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    http = httpx.Client(timeout=10)
    sent = 0

    def call(url: str) -> int:
        nonlocal sent
        sent += 1
        return http.post(f"{url}/chat/completions", json=body, headers=headers).status_code

    assert [call(open_url) for _ in range(3)] == [200] * 3
    wait_until(lambda: control.redis.xlen("inferops:usage") == 3, "three usage events", timeout=10.0)

    private_redis.stop()
    assert [call(open_url) for _ in range(6)] == [200] * 6  # keys and routes from memory, limits open
    assert call(closed_url) == 503  # the other policy refuses instead
    spool = tmp_path / "spool" / "test-0.jsonl"
    wait_until(lambda: spool.exists() and len(spool.read_text().splitlines()) == 6, "six spooled events",
               timeout=10.0)
    assert _metric(http, open_url, "inferops_gateway_redis_up") == 0
    assert _metric(http, open_url, "inferops_gateway_usage_spool_depth") == 6
    assert _metric(http, open_url, "inferops_gateway_limits_bypassed_total") == 6
    assert http.get(open_url.removesuffix("/v1") + "/health").json()["redis"] == "down"

    private_redis.start()
    wait_until(lambda: control.redis.xlen("inferops:usage") == sent, "every event replayed", timeout=10)
    events = control.events()
    assert len({e["request_id"] for e in events}) == sent == 10
    assert [e["status"] for e in events].count(200) == 9 and events[-1]["status"] == 503
    assert spool.read_text() == "" and _metric(http, open_url, "inferops_gateway_usage_spool_depth") == 0
    wait_until(lambda: _metric(http, open_url, "inferops_gateway_redis_up") == 1, "redis_up back to 1", timeout=10.0)

    # A flushed Redis (the control plane republishes within 30 s) does not empty the gateway:
    # once its poll has read the empty Redis, it still knows the key and the route.
    reads = []
    read_redis = open_gateway.state.refresh

    async def counted_refresh() -> bool:
        answered = await read_redis()
        reads.append(answered)
        return answered

    open_gateway.state.refresh = counted_refresh
    control.redis.flushall()
    # Two reads: the first may have begun before the flush.
    wait_until(lambda: reads.count(True) >= 2, "the gateway to read the flushed Redis twice", timeout=5.0)
    assert call(open_url) == 200
    assert len(open_gateway.state.snapshot.keys) == 1
    http.close()
    control.redis.close()


def test_a_gateway_started_before_redis_serves_once_redis_and_the_control_plane_are_up(
        replicas, gateways, tmp_path):
    (replica,) = replicas(1)
    server = RedisProcess(tmp_path)  # not started yet
    gateway, base_url = gateways(server.url)
    http = httpx.Client(timeout=10)
    try:
        assert http.get(base_url.removesuffix("/v1") + "/health").json()["redis"] == "down"
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
        early = http.post(f"{base_url}/chat/completions", json=body, headers={"Authorization": "Bearer iop_x_y"})
        assert early.status_code == 401  # no key is known yet; the refusal is spooled
        server.start()
        control = Control(server.url)
        control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
        secret, _ = control.publish_key("acme")
        wait_until(lambda: http.post(f"{base_url}/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {secret}"}).status_code == 200,
                   "the key to be served once Redis is up", timeout=5)
        # The refusal from before Redis was up reached the stream first (spooled, then replayed).
        wait_until(lambda: any(e["status"] == 200 for e in control.events()), "the served request's event",
                   timeout=10.0)
        assert control.events()[0]["status"] == 401
        control.redis.close()
    finally:
        http.close()
        server.stop()
