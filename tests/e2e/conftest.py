"""What the end-to-end suites share: a private Redis a test may stop and start, gateway processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
import redis

from tests.conftest import free_port
from tests.processes import stop_process
from tests.waiting import wait_until


class RedisServer:
    """A private redis-server (append-only on, like production) that tests may stop and start."""

    def __init__(self, directory):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.directory = directory
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: redis.Redis.from_url(self.url).ping(), "redis", 10, 0.2, ignore=(redis.ConnectionError,))

    def stop(self):
        if self.process:
            stop_process(self.process)


@pytest.fixture
def private_redis(tmp_path, settings):
    server = RedisServer(tmp_path)
    server.start()
    settings.REDIS_URL = server.url  # the control plane publishes and ingests here
    yield server
    server.stop()


def start_gateway(redis_url: str, spool_dir, extra_env=None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, **(extra_env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "project.cli", "gateway", "--port", str(port), "--redis-url", redis_url,
         "--spool-dir", str(spool_dir), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{base}/health", timeout=1).status_code == 200, "gateway /health", 30, 0.2,
               ignore=(httpx.TransportError,))
    return process, base


def stop_stack(worker: subprocess.Popen, gateway: subprocess.Popen | None) -> None:
    """Kill a test's worker (and the beat in its session), its gateway, and every replica left running."""
    from deployments.models import Replica
    from deployments.replicas.drivers.local import LocalProcessDriver

    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(30)
    if gateway is not None and gateway.poll() is None:
        gateway.send_signal(signal.SIGKILL)
    for leftover in Replica.objects.all():
        LocalProcessDriver().kill(leftover)


def gateway_client(redis_url: str, spool_dir, key: str) -> tuple[subprocess.Popen, str, openai.OpenAI]:
    """A gateway on `redis_url` and an `openai` client with `key`, once the gateway knows the key and a route."""
    gateway, base = start_gateway(redis_url, spool_dir)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    wait_until(lambda: client.models.list().data, "gateway to learn the key and route", 15, 0.2,
               ignore=(openai.APIError,))
    return gateway, base, client
