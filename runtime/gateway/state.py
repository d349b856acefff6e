"""The gateway's in-memory copy of what the control plane publishes: routing table, degradation
entries and API keys.

Requests never wait on Redis for these: they read the last snapshot. A background task refreshes
it when a pub/sub message says something changed, and polls the generation counters every
second as a fallback (a pub/sub message is lost while the subscriber reconnects), so a revoked
key stops working within about a second on every instance. When Redis is unreachable the last
snapshot stays in use for as long as it takes.

A key missing from the snapshot is looked up in Redis once before the gateway answers 401, so a
key works on every instance the moment it is published. Keys found that way and misses are
remembered only until the next snapshot replaces the current one (a miss at most
NEGATIVE_CACHE_S), so revocation still acts within the poll interval and a flood of bad keys
costs Redis one HGET per distinct key per NEGATIVE_CACHE_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.gateway.contract import (
    DEFAULT_HOLD_MAX_QUEUE,
    DEFAULT_HOLD_MAX_WAIT_S,
    DEGRADATION_CHANNEL,
    DEGRADATION_GENERATION_KEY,
    DEGRADATION_KEY,
    KEYS_CHANNEL,
    KEYS_GENERATION_KEY,
    KEYS_KEY,
    PREVIEW_SUFFIX,
    ROUTING_CHANNEL,
    ROUTING_GENERATION_KEY,
    ROUTING_KEY,
    SLO_TARGETS_CHANNEL,
    SLO_TARGETS_GENERATION_KEY,
    SLO_TARGETS_KEY,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)

logger = logging.getLogger(__name__)

NEGATIVE_CACHE_S = 5.0
NEGATIVE_CACHE_MAX = 100_000  # distinct bad keys remembered; beyond, the oldest are forgotten

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
class Fallback:
    """Where a degraded deployment sends part of its traffic: every request whose priority is in
    `priorities`, and `weight` percent of the others."""

    deployment: str
    weight: int
    priorities: frozenset[int]

    def takes(self, priority: int, draw: float) -> bool:
        """`draw` is uniform in [0, 1): the caller's random number, so tests can pin it."""
        return priority in self.priorities or draw * 100 < self.weight


@dataclass(frozen=True)
class Degradation:
    """The actions of the level a deployment's degradation policy is at (level >= 1)."""

    level: int
    name: str
    shed_below_priority: int | None = None
    max_tokens_cap: int | None = None
    fallback: Fallback | None = None
    retry_after_s: int = 30

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Degradation | None:
        if not data or not int(data.get("level") or 0):
            return None
        fallback = data.get("fallback")
        return cls(
            level=int(data["level"]), name=str(data.get("name") or ""),
            shed_below_priority=_optional_int(data.get("shed_below_priority")),
            max_tokens_cap=_optional_int(data.get("max_tokens_cap")),
            fallback=Fallback(str(fallback["deployment"]), int(fallback.get("weight") or 0),
                              frozenset(int(p) for p in fallback.get("priorities") or ())) if fallback else None,
            retry_after_s=max(1, int(data.get("retry_after_s") or 30)),
        )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class ScaleFromZero:
    """How a gateway holds requests for a deployment that may park (no replica): at most
    `max_queue` at once, each for at most `max_wait_s`, while the control plane starts one."""

    max_wait_s: float = DEFAULT_HOLD_MAX_WAIT_S
    max_queue: int = DEFAULT_HOLD_MAX_QUEUE

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ScaleFromZero | None:
        if data is None:
            return None
        return cls(max(0.0, float(data.get("max_wait_s", DEFAULT_HOLD_MAX_WAIT_S))),
                   max(0, int(data.get("max_queue", DEFAULT_HOLD_MAX_QUEUE))))


@dataclass(frozen=True)
class Route:
    deployment: str
    task: str
    versions: tuple[Version, ...]
    backend: str = "builtin"
    degradation: Degradation | None = None
    published_at: float = 0.0
    scale_from_zero: ScaleFromZero | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Route:
        versions = tuple(
            Version(int(v["version"]), int(v.get("weight") or 0),
                    tuple(Replica(int(r["id"]), r["url"].rstrip("/")) for r in v.get("replicas") or ()))
            for v in data.get("versions") or ())
        return cls(data["deployment"], data.get("task", "generate"), versions, data.get("backend", "builtin"),
                   Degradation.from_json(data.get("degradation")), float(data.get("published_at") or 0),
                   ScaleFromZero.from_json(data.get("scale_from_zero")))

    @property
    def has_ready_replica(self) -> bool:
        """Whether any replica may take traffic (the router's NoReplica otherwise)."""
        return any(v.weight > 0 and v.replicas for v in self.versions)


@dataclass(frozen=True)
class DegradationEntry:
    """A deployment's entry in DEGRADATION_KEY: the level in force (None: level 0) and the TTFT
    deadlines its gateways count verdicts against."""

    degradation: Degradation | None
    ttft_deadlines_ms: tuple[float, ...]
    published_at: float

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DegradationEntry:
        return cls(Degradation.from_json(data.get("degradation")),
                   tuple(sorted({float(ms) for ms in data.get("ttft_deadlines_ms") or () if float(ms) > 0})),
                   float(data.get("published_at") or 0))


def with_degradation(routes: dict[str, Route], entries: dict[str, DegradationEntry]) -> dict[str, Route]:
    """The routes with the level of whichever was published later, the routing entry or the
    degradation entry (a level change arrives in the latter at once, in the former with the next
    reconcile pass). A rollout's preview route has no entry: it is never degraded."""
    merged = dict(routes)
    for name, entry in entries.items():
        route = routes.get(name)
        if route is not None and entry.published_at > route.published_at and route.degradation != entry.degradation:
            merged[name] = replace(route, degradation=entry.degradation)
    return merged


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


@dataclass(frozen=True)
class SloTargets:
    """A tenant's tightest TTFT and TPOT targets on a deployment (ms), sent to built-in replicas
    as headers so the engine schedules the tenant's requests for them."""

    ttft_ms: float | None
    tpot_ms: float | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SloTargets:
        def positive(value: Any) -> float | None:
            return float(value) if value is not None and float(value) > 0 else None
        return cls(positive(data.get("ttft_ms")), positive(data.get("tpot_ms")))

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(name.encode(), f"{value:g}".encode())
                for name, value in ((SLO_TTFT_HEADER, self.ttft_ms), (SLO_TPOT_HEADER, self.tpot_ms))
                if value is not None]


@dataclass
class Snapshot:
    """What requests read; replaced as a whole (never mutated) so readers need no lock."""

    routes: dict[str, Route] = field(default_factory=dict)
    keys: dict[str, ApiKey] = field(default_factory=dict)
    ttft_deadlines: dict[str, tuple[float, ...]] = field(default_factory=dict)  # deployment -> deadlines (ms)
    slo_targets: dict[str, SloTargets] = field(default_factory=dict)  # by slo_targets_field(deployment, tenant)


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

    GENERATIONS = (ROUTING_GENERATION_KEY, KEYS_GENERATION_KEY, DEGRADATION_GENERATION_KEY, SLO_TARGETS_GENERATION_KEY)

    def __init__(self, client: aioredis.Redis, health: RedisHealth, poll_interval_s: float = 1.0) -> None:
        self.client = client
        self.health = health
        self.poll_interval_s = poll_interval_s
        self.snapshot = Snapshot()
        # Set when `snapshot` is replaced, then swapped for a fresh one: waiters (held requests)
        # wake on the next routing change instead of polling.
        self.snapshot_replaced = asyncio.Event()
        self._generations: tuple[Any, ...] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._found: dict[str, ApiKey] = {}  # looked up since the snapshot was taken
        self._missing: dict[str, float] = {}  # key hash -> monotonic time its miss is forgotten
        self._lookups: dict[str, asyncio.Future[ApiKey | None]] = {}

    async def find_key(self, key_hash: str) -> ApiKey | None:
        """The key from the snapshot, else from Redis (see the module docstring); None: unknown."""
        key = self.snapshot.keys.get(key_hash) or self._found.get(key_hash)
        if key is not None:
            return key
        forget_at = self._missing.get(key_hash)
        if forget_at is not None and time.monotonic() < forget_at:
            return None
        if not self.health.worth_trying():
            return None
        # Concurrent requests with the same unknown key share one lookup.
        pending = self._lookups.get(key_hash)
        if pending is None:
            pending = self._lookups[key_hash] = asyncio.ensure_future(self._look_up(key_hash))
            pending.add_done_callback(lambda _: self._lookups.pop(key_hash, None))
        return await asyncio.shield(pending)

    async def _look_up(self, key_hash: str) -> ApiKey | None:
        snapshot = self.snapshot
        try:
            raw = await self.client.hget(KEYS_KEY, key_hash)
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)
            return None
        self.health.mark_up()
        key = _decode_hash({key_hash.encode(): raw}, ApiKey.from_json).get(key_hash) if raw else None
        # A refresh that replaced the snapshot meanwhile may have seen this key revoked: keep nothing.
        if self.snapshot is snapshot:
            if key is not None:
                self._found[key_hash] = key
            else:
                if len(self._missing) >= NEGATIVE_CACHE_MAX:
                    for old in list(self._missing)[:NEGATIVE_CACHE_MAX // 10]:
                        del self._missing[old]
                self._missing[key_hash] = time.monotonic() + NEGATIVE_CACHE_S
        return key

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
        """Reload the tables if any generation moved; False when Redis did not answer."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name in self.GENERATIONS:
                    pipe.get(name)
                generations = tuple(await pipe.execute())
            flushed = all(generation is None for generation in generations)
            # A flushed Redis has no generation at all, and the control plane then republishes
            # under a new one, so "different" (not "greater") is what counts.
            if generations != self._generations or flushed:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.hgetall(ROUTING_KEY)
                    pipe.hgetall(KEYS_KEY)
                    pipe.hgetall(DEGRADATION_KEY)
                    pipe.hgetall(SLO_TARGETS_KEY)
                    routes_raw, keys_raw, degradation_raw, targets_raw = await pipe.execute()
                if flushed and not routes_raw and not keys_raw and self._generations:
                    # Flushed Redis: keep the last copy until the control plane republishes.
                    self.health.mark_up()
                    return True
                entries = _decode_hash(degradation_raw, DegradationEntry.from_json)
                self._install(Snapshot(
                    with_degradation(_decode_hash(routes_raw, Route.from_json), entries),
                    _decode_hash(keys_raw, ApiKey.from_json),
                    {name: entry.ttft_deadlines_ms for name, entry in entries.items() if entry.ttft_deadlines_ms},
                    _decode_hash(targets_raw, SloTargets.from_json)))
                self._found, self._missing = {}, {}
                self._generations = generations
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)
            return False
        self.health.mark_up()
        return True

    def _install(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        replaced, self.snapshot_replaced = self.snapshot_replaced, asyncio.Event()
        replaced.set()

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
                await pubsub.subscribe(ROUTING_CHANNEL, KEYS_CHANNEL, DEGRADATION_CHANNEL, SLO_TARGETS_CHANNEL)
                async for message in pubsub.listen():
                    if message["type"] == "message":
                        self._wake.set()
            except (RedisError, OSError):
                await asyncio.sleep(self.poll_interval_s)  # the poll loop reports the outage
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
