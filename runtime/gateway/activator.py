"""Holding requests for a parked deployment (scale to zero) until its first replica is ready, as
Knative's activator does.

A request that finds no ready replica for a deployment whose route has `scale_from_zero` waits
here instead of getting a 503. One watcher task per deployment with held requests asks the control
plane for a replica (ACTIVATION_KEY and ACTIVATION_CHANNEL, again every ACTIVATION_REFRESH_S, which
heals a lost signal) and releases every held request the moment a routing snapshot lists a ready
replica. Both limits of the route are this gateway's: at most `max_queue` requests held at once,
each for at most `max_wait_s`. While Redis is down requests stay held until their wait runs out:
the replica may still come.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.gateway import clock
from runtime.gateway.contract import ACTIVATION_CHANNEL, ACTIVATION_KEY, ACTIVATION_REFRESH_S
from runtime.gateway.metrics import GatewayMetrics
from runtime.gateway.state import RedisHealth, ScaleFromZero, StateSync

# How a hold ended (the outcome label of inferops_gateway_hold_seconds).
RELEASED, TIMEOUT, FULL, SHUTDOWN, GONE = "released", "timeout", "full", "shutdown", "gone"
# A cold start takes seconds to minutes: retrying sooner would only meet the same full queue.
COLD_START_RETRY_AFTER_S = 5


class HoldRefused(Exception):
    """A request the hold could not serve: its message is the client's 503."""

    def __init__(self, outcome: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.retry_after_s = retry_after_s


class Activator:
    def __init__(self, state: StateSync, client: aioredis.Redis, health: RedisHealth, metrics: GatewayMetrics,
                 instance: str, refresh_s: float = ACTIVATION_REFRESH_S) -> None:
        self.state = state
        self.client = client
        self.health = health
        self.metrics = metrics
        self.instance = instance
        self.refresh_s = refresh_s
        self._held: dict[str, set[asyncio.Future[str]]] = {}  # deployment -> one future per held request
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    async def hold(self, name: str, limits: ScaleFromZero) -> None:
        """Return once the route `name` has a ready replica (or was deleted); raises HoldRefused."""
        started = time.monotonic()
        outcome = GONE  # unless set below: the client went away (this task was cancelled)
        try:
            if self._closing:
                outcome = SHUTDOWN
                raise self._shutdown_refusal(name, 0.0)
            if len(self._held.get(name, ())) >= limits.max_queue:
                outcome = FULL
                raise HoldRefused(FULL, f"`{name}` is starting from zero (cold start): this gateway already holds "
                                  f"{limits.max_queue} requests for it, its limit, so this one was refused without "
                                  "waiting. Retry in a few seconds: its first replica is on the way.",
                                  COLD_START_RETRY_AFTER_S)
            waiting = self._held.setdefault(name, set())
            released = asyncio.get_running_loop().create_future()
            waiting.add(released)
            self._count_held(name)
            if name not in self._watchers:
                self._watchers[name] = asyncio.create_task(self._watch(name))
            try:
                async with asyncio.timeout(limits.max_wait_s):
                    outcome = await released
            except TimeoutError:
                outcome = TIMEOUT
                raise HoldRefused(
                    TIMEOUT, f"`{name}` is starting from zero (cold start) and no replica was ready after "
                    f"{time.monotonic() - started:.1f} s, the longest a request is held for it. Retry in a few "
                    "seconds; if this keeps happening, its replicas fail to start or start slower than the "
                    "hold allows (raise its autoscaling hold.max_wait_s, or keep min_replicas above 0).",
                    COLD_START_RETRY_AFTER_S) from None
            finally:
                waiting.discard(released)
                if not waiting and self._held.get(name) is waiting:
                    del self._held[name]
                self._count_held(name)
            if outcome == SHUTDOWN:
                raise self._shutdown_refusal(name, time.monotonic() - started)
        finally:
            self.metrics.hold_seconds.labels(name, outcome).observe(time.monotonic() - started)

    async def close(self) -> None:
        """Shutting down: answer every held request at once (HoldRefused) and hold no new one."""
        self._closing = True
        for name in list(self._held):
            self._release(name, SHUTDOWN)
        watchers = list(self._watchers.values())
        for watcher in watchers:
            watcher.cancel()
        for watcher in watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    def _shutdown_refusal(self, name: str, held_s: float) -> HoldRefused:
        return HoldRefused(SHUTDOWN, f"This gateway is shutting down while `{name}` starts from zero (cold "
                           f"start); the request was held {held_s:.1f} s. Retry: another gateway instance or "
                           "this one after restart will serve it.", 1)

    async def _watch(self, name: str) -> None:
        """While requests for `name` are held: release them once its route has a ready replica (or is
        gone: the caller answers 404), and ask for a replica every refresh_s meanwhile."""
        signal_at = 0.0
        try:
            while True:
                replaced = self.state.snapshot_replaced  # taken first: a snapshot installed while we signal wakes us
                waiting = self._held.get(name)
                if not waiting:
                    return
                route = self.state.snapshot.routes.get(name)
                if route is None or route.has_ready_replica:
                    self._release(name, RELEASED)
                    return
                if time.monotonic() >= signal_at:
                    await self._signal(name, len(waiting))
                    signal_at = time.monotonic() + self.refresh_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, signal_at - time.monotonic())):
                        await replaced.wait()
        finally:
            self._watchers.pop(name, None)

    def _release(self, name: str, outcome: str) -> None:
        for released in self._held.pop(name, ()):
            if not released.done():
                released.set_result(outcome)
        self._count_held(name)

    async def _signal(self, name: str, held: int) -> None:
        if not self.health.worth_trying():
            return
        entry = json.dumps({"at": clock.now(), "held": held, "gateway": self.instance})
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(ACTIVATION_KEY, name, entry)
                pipe.publish(ACTIVATION_CHANNEL, name)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)  # held requests wait on: the replica may come anyway
            return
        self.health.mark_up()

    def _count_held(self, name: str) -> None:
        self.metrics.held.labels(name).set(len(self._held.get(name, ())))
