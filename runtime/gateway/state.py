"""The gateway's in-memory copy of what the control plane publishes: routing table and API keys.

Requests never wait on Redis for these: they read the last snapshot. A background task refreshes
it when a pub/sub message says something changed, and polls both generation counters every
second as a fallback (a pub/sub message is lost while the subscriber reconnects), so a revoked
key stops working within about a second on every instance. When Redis is unreachable the last
snapshot stays in use for as long as it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

ROUTING_KEY = "inferops:routing"
ROUTING_GENERATION_KEY = "inferops:routing:generation"
ROUTING_CHANNEL = "inferops:routing:changed"
KEYS_KEY = "inferops:keys"
KEYS_GENERATION_KEY = "inferops:keys:generation"
KEYS_CHANNEL = "inferops:keys:changed"

# `<deployment>--preview`: a rollout's candidate alone, for smoke tests before it takes traffic.
PREVIEW_SUFFIX = "--preview"


def hash_api_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class ScopeLimits:
    """Limits of one scope (a key or a tenant); None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ScopeLimits:
        data = data or {}
        return cls(data.get("rpm"), data.get("tpm"), data.get("max_concurrent"))

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrent is None


@dataclass(frozen=True)
class ApiKey:
    prefix: str
    name: str
    tenant: str
    deployments: frozenset[str]  # empty: every deployment
    priority: int
    expires_at: float | None
    key_limits: ScopeLimits
    tenant_limits: ScopeLimits

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ApiKey:
        limits = data.get("limits") or {}
        return cls(prefix=data["prefix"], name=data.get("name", ""), tenant=data["tenant"],
                   deployments=frozenset(data.get("deployments") or ()),
                   priority=int(data.get("priority") or 0), expires_at=data.get("expires_at"),
                   key_limits=ScopeLimits.from_json(limits.get("key")),
                   tenant_limits=ScopeLimits.from_json(limits.get("tenant")))

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def may_use(self, deployment: str) -> bool:
        """A key allowed a deployment may also call its rollout's preview route."""
        return (not self.deployments or deployment in self.deployments
                or deployment.removesuffix(PREVIEW_SUFFIX) in self.deployments)


@dataclass(frozen=True)
class Replica:
    id: int
    url: str


@dataclass(frozen=True)
class Version:
    number: int
    weight: int
    replicas: tuple[Replica, ...]


@dataclass(frozen=True)
class Route:
    deployment: str
    task: str
    versions: tuple[Version, ...]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Route:
        versions = tuple(
            Version(int(v["version"]), int(v.get("weight") or 0),
                    tuple(Replica(int(r["id"]), r["url"].rstrip("/")) for r in v.get("replicas") or ()))
            for v in data.get("versions") or ())
        return cls(data["deployment"], data.get("task", "generate"), versions)


def _decode_hash(raw: dict[bytes, bytes], parse: Any) -> dict[str, Any]:
    parsed = {}
    for field_name, value in raw.items():
        name = field_name.decode()
        try:
            parsed[name] = parse(json.loads(value))
        except (ValueError, KeyError, TypeError) as exc:
            # One malformed entry must not take every other key or route down with it.
            logger.error("ignoring malformed entry %r: %s", name, exc)
    return parsed


@dataclass
class Snapshot:
    """What requests read; replaced as a whole (never mutated) so readers need no lock."""

    routes: dict[str, Route] = field(default_factory=dict)
    keys: dict[str, ApiKey] = field(default_factory=dict)


class RedisHealth:
    """Whether Redis answered lately; after a failure callers skip it for `retry_s` instead of
    paying a connect timeout on every request."""

    def __init__(self, retry_s: float = 1.0) -> None:
        self.retry_s = retry_s
        self.up = True
        self._retry_at = 0.0
        self.listeners: list[Any] = []

    def worth_trying(self) -> bool:
        return self.up or time.monotonic() >= self._retry_at

    def mark_down(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self.retry_s
        if self.up:
            logger.warning("redis unreachable: %s", exc)
            self.up = False
            self._notify()

    def mark_up(self) -> None:
        if not self.up:
            logger.warning("redis reachable again")
            self.up = True
            self._notify()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener(self.up)


class StateSync:
    """Keeps `snapshot` in step with Redis: pub/sub for speed, a 1 s generation poll for safety."""

    def __init__(self, client: aioredis.Redis, health: RedisHealth, poll_interval_s: float = 1.0) -> None:
        self.client = client
        self.health = health
        self.poll_interval_s = poll_interval_s
        self.snapshot = Snapshot()
        self._generations: tuple[Any, Any] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.create_task(self._poll_loop()), asyncio.create_task(self._listen_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def refresh(self) -> bool:
        """Reload both tables if either generation moved; False when Redis did not answer."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(ROUTING_GENERATION_KEY)
                pipe.get(KEYS_GENERATION_KEY)
                generations = tuple(await pipe.execute())
            # A flushed Redis has no generation at all, and the control plane then republishes
            # under a new one, so "different" (not "greater") is what counts.
            if generations != self._generations or generations == (None, None):
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.hgetall(ROUTING_KEY)
                    pipe.hgetall(KEYS_KEY)
                    routes_raw, keys_raw = await pipe.execute()
                if generations == (None, None) and not routes_raw and not keys_raw and self._generations:
                    # Flushed Redis: keep the last copy until the control plane republishes.
                    self.health.mark_up()
                    return True
                self.snapshot = Snapshot(_decode_hash(routes_raw, Route.from_json),
                                         _decode_hash(keys_raw, ApiKey.from_json))
                self._generations = generations
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)
            return False
        self.health.mark_up()
        return True

    async def _poll_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            await self.refresh()

    async def _listen_loop(self) -> None:
        while True:
            pubsub = self.client.pubsub()
            try:
                await pubsub.subscribe(ROUTING_CHANNEL, KEYS_CHANNEL)
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._wake.set()
            except (RedisError, OSError):
                await asyncio.sleep(self.poll_interval_s)  # the poll loop reports the outage
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
