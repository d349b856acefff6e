"""Gateway fixtures: real Redis, gateways and fake replicas served by uvicorn in threads.

Keys and routes are published the way the control plane does it (the Redis keys of the
contract, written directly), so these tests need neither Postgres nor Django.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime.gateway.contract import (
    DEGRADATION_CHANNEL,
    DEGRADATION_GENERATION_KEY,
    DEGRADATION_KEY,
    KEYS_CHANNEL,
    KEYS_GENERATION_KEY,
    KEYS_KEY,
    ROUTING_CHANNEL,
    ROUTING_GENERATION_KEY,
    ROUTING_KEY,
    SLO_LATE,
    SLO_TARGETS_CHANNEL,
    SLO_TARGETS_GENERATION_KEY,
    SLO_TARGETS_KEY,
    TTFT_VERDICTS_PREFIX,
    USAGE_STREAM,
    hash_api_key,
    ttft_verdicts_key,
)
from runtime.gateway.server import Gateway, GatewaySettings
from tests.conftest import free_port
from tests.waiting import wait_until

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/13")


class ThreadedServer:
    """Any ASGI app under uvicorn in a daemon thread (its own event loop)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                loop="asyncio", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ThreadedServer:
        self.thread.start()

        def started() -> bool:
            if not self.server.started and not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            return self.server.started

        wait_until(started, f"the server on port {self.port} to start", 10, 0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Behaviour:
    """What the fake replica does; tests change it between requests."""

    first_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    chunks: list[str] = field(default_factory=lambda: ["Hel", "lo", " wor", "ld"])
    fail_status: int | None = None  # answer this status (with an OpenAI error body) instead
    refuse_late: bool = False  # answer as a built-in replica under --slo-reject-late does: 503 slo_late
    break_after_chunks: int | None = None  # drop the connection mid-stream
    prompt_tokens: int = 7


class FakeReplica:
    """A small OpenAI-compatible responder that stands in for a replica to test the proxy alone.

    It serves /v1/chat/completions, /v1/completions and /v1/embeddings with configurable delays,
    chunks, errors and usage, and records what it received, how many requests were in flight at
    most, and which streams ended early because the gateway closed them.
    """

    def __init__(self, replica_id: int) -> None:
        self.id = replica_id
        self.behaviour = Behaviour()
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # of each generation request, as received
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0
        self.completed = 0
        app = Starlette(routes=[Route("/v1/chat/completions", self.generate, methods=["POST"]),
                                Route("/v1/completions", self.generate, methods=["POST"]),
                                Route("/v1/embeddings", self.embeddings, methods=["POST"])])
        self.server = ThreadedServer(app)
        self.url = self.server.url

    async def embeddings(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.bodies.append(body)
        return JSONResponse({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                             "model": body["model"], "usage": {"prompt_tokens": 3, "total_tokens": 3}})

    async def generate(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        b = self.behaviour
        if b.refuse_late:
            return JSONResponse({"error": {"message": "late", "type": "ServiceUnavailableError", "param": None,
                                           "code": SLO_LATE}}, status_code=503, headers={"Retry-After": "3"})
        chat = request.url.path.endswith("chat/completions")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if not body.get("stream"):
            try:
                await asyncio.sleep(b.first_delay_s + b.chunk_delay_s * len(b.chunks))
            finally:
                self.in_flight -= 1
            if b.fail_status:
                return JSONResponse({"error": {"message": "fake failure", "type": "InternalServerError",
                                               "param": None, "code": b.fail_status}}, status_code=b.fail_status)
            text = "".join(b.chunks)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            self.completed += 1
            return JSONResponse({"id": "fake", "object": "chat.completion" if chat else "text_completion",
                                 "model": body["model"], "choices": [choice], "usage": self._usage()})
        if b.fail_status:
            self.in_flight -= 1
            return JSONResponse({"error": {"message": "fake failure", "type": "InternalServerError", "param": None,
                                           "code": b.fail_status}}, status_code=b.fail_status)
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True
        return StreamingResponse(self._stream(chat, include_usage), media_type="text/event-stream")

    def _usage(self) -> dict:
        b = self.behaviour
        return {"prompt_tokens": b.prompt_tokens, "completion_tokens": len(b.chunks),
                "total_tokens": b.prompt_tokens + len(b.chunks)}

    async def _stream(self, chat: bool, include_usage: bool):
        b = self.behaviour
        finished = False
        try:
            await asyncio.sleep(b.first_delay_s)
            for index, text in enumerate(b.chunks):
                if b.break_after_chunks is not None and index == b.break_after_chunks:
                    raise ConnectionAbortedError("fake replica dies mid-stream")
                if index:
                    await asyncio.sleep(b.chunk_delay_s)
                last = index == len(b.chunks) - 1
                choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
                choice["finish_reason"] = "length" if last else None
                yield "data: " + json.dumps({"id": "fake", "object": "chunk", "choices": [choice]},
                                            separators=(",", ":")) + "\n\n"
            if include_usage:
                yield "data: " + json.dumps({"id": "fake", "object": "chunk", "choices": [],
                                             "usage": self._usage()}, separators=(",", ":")) + "\n\n"
            yield "data: [DONE]\n\n"
            finished = True
            self.completed += 1
        finally:
            self.in_flight -= 1
            if not finished:
                self.cancelled += 1


class Control:
    """Publishes routes and keys as the control plane does, and reads usage events back."""

    def __init__(self, url: str) -> None:
        self.redis = redis.Redis.from_url(url)

    def clean(self) -> None:
        self.redis.delete(ROUTING_KEY, KEYS_KEY, USAGE_STREAM, DEGRADATION_KEY, SLO_TARGETS_KEY)
        for pattern in ("inferops:rl:*", f"{TTFT_VERDICTS_PREFIX}:*"):
            for name in self.redis.scan_iter(pattern):
                self.redis.delete(name)

    def publish_route(self, deployment: str, versions: list[tuple[int, int, list[tuple[int, str]]]],
                      task: str = "generate", backend: str = "builtin", degradation: dict | None = None) -> None:
        entry = {"deployment": deployment, "model": deployment, "task": task, "backend": backend,
                 "versions": [{"version": number, "weight": weight,
                               "replicas": [{"id": rid, "url": url} for rid, url in replicas]}
                              for number, weight, replicas in versions],
                 "published_at": time.time(), "degradation": degradation}
        self.redis.hset(ROUTING_KEY, deployment, json.dumps(entry))
        self.redis.incr(ROUTING_GENERATION_KEY)
        self.redis.publish(ROUTING_CHANNEL, deployment)

    def publish_degradation(self, deployment: str, degradation: dict | None,
                            ttft_deadlines_ms: list[float] | None = None) -> None:
        """As the degradation engine does the moment a level (or a watched deadline) changes."""
        entry = {"degradation": degradation, "ttft_deadlines_ms": ttft_deadlines_ms or [], "published_at": time.time()}
        self.redis.hset(DEGRADATION_KEY, deployment, json.dumps(entry))
        self.redis.incr(DEGRADATION_GENERATION_KEY)
        self.redis.publish(DEGRADATION_CHANNEL, deployment)

    def publish_slo_targets(self, table: dict[str, dict]) -> None:
        """As slo/engine_targets.py does: the whole tenant targets table, replaced."""
        self.redis.delete(SLO_TARGETS_KEY)
        if table:
            self.redis.hset(SLO_TARGETS_KEY, mapping={name: json.dumps(value) for name, value in table.items()})
        self.redis.incr(SLO_TARGETS_GENERATION_KEY)
        self.redis.publish(SLO_TARGETS_CHANNEL, "slo-targets")

    def ttft_verdicts(self, deployment: str) -> dict[str, int]:
        """`<deadline>:<good|bad>` -> count, over the last few minutes' counters."""
        minute = int(time.time()) // 60
        counts: dict[str, int] = {}
        for key in (ttft_verdicts_key(deployment, m) for m in range(minute - 2, minute + 1)):
            for name, value in self.redis.hgetall(key).items():
                deadline, _, verdict = name.decode().split(":")
                counts[f"{deadline}:{verdict}"] = counts.get(f"{deadline}:{verdict}", 0) + int(value)
        return counts

    def publish_key(self, tenant: str = "acme", deployments: list[str] | None = None, *,
                    key_limits: dict | None = None, tenant_limits: dict | None = None,
                    expires_at: float | None = None, priority: int = 1) -> tuple[str, str]:
        """A new key; returns (secret, prefix)."""
        prefix = uuid.uuid4().hex[:8]
        secret = f"iop_{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:8]}"
        record = {"prefix": prefix, "name": f"test-{prefix}", "tenant": tenant, "deployments": deployments or [],
                  "priority": priority, "expires_at": expires_at,
                  "limits": {"key": _limits(key_limits), "tenant": _limits(tenant_limits)}}
        self.redis.hset(KEYS_KEY, hash_api_key(secret), json.dumps(record))
        self.redis.incr(KEYS_GENERATION_KEY)
        self.redis.publish(KEYS_CHANNEL, prefix)
        return secret, prefix

    def revoke(self, secret: str, announce: bool = True) -> None:
        self.redis.hdel(KEYS_KEY, hash_api_key(secret))
        self.redis.incr(KEYS_GENERATION_KEY)
        if announce:
            self.redis.publish(KEYS_CHANNEL, "revoked")

    def events(self) -> list[dict]:
        return [json.loads(fields[b"e"]) for _, fields in self.redis.xrange(USAGE_STREAM)]

    def wait_events(self, count: int, timeout: float = 5.0) -> list[dict]:
        """The usage events, once at least `count` are in the stream."""

        def enough() -> list[dict] | None:
            events = self.events()
            return events if len(events) >= count else None

        return wait_until(enough, lambda: f"{count} usage events (have {len(self.events())})", timeout, 0.02)


def _limits(values: dict | None) -> dict:
    return {"rpm": None, "tpm": None, "max_concurrent": None, **(values or {})}


@pytest.fixture
def control() -> Control:
    control = Control(REDIS_URL)
    control.clean()
    yield control
    control.clean()
    control.redis.close()


@pytest.fixture
def replicas():
    """`replicas(n)` starts n fake replicas (ids 1..n); all are stopped after the test."""
    started: list[FakeReplica] = []

    def start(count: int) -> list[FakeReplica]:
        new = [FakeReplica(len(started) + i + 1) for i in range(count)]
        for replica in new:
            replica.server.start()
        started.extend(new)
        return new

    yield start
    for replica in started:
        replica.server.stop()


@pytest.fixture
def gateways(tmp_path: Path):
    """`gateways(**settings)` starts a gateway app under uvicorn; all are stopped after the test."""
    started: list[ThreadedServer] = []

    def start(redis_url: str = REDIS_URL, **overrides: Any) -> tuple[Gateway, str]:
        index = len(started)
        settings = GatewaySettings(redis_url=redis_url, instance=f"test-{index}", spool_dir=tmp_path / "spool",
                                   **overrides)
        gateway = Gateway(settings)
        server = ThreadedServer(gateway).start()
        started.append(server)
        return gateway, f"{server.url}/v1"

    yield start
    for server in started:
        server.stop()
