"""Early TTFT verdicts: a streamed request is judged against its deployment's TTFT deadlines when
its first token arrives, or as late when a deadline passes first, and counted per minute in Redis
(the contract's TTFT verdict counters), so the degradation engine sees an overload while it
happens instead of when its requests end.

Requests only bump an in-memory counter; a writer task sends what gathered every `flush_s` in one
pipeline. A flush that fails is dropped: these counts are an early signal, and each request's
usage event still carries its exact verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.gateway import clock
from runtime.gateway.contract import TTFT_VERDICTS_TTL_S, ttft_verdict_field, ttft_verdicts_key
from runtime.gateway.state import RedisHealth
from runtime.gateway.usage import BackgroundWriter

logger = logging.getLogger(__name__)


class TtftVerdicts(BackgroundWriter):
    def __init__(self, client: aioredis.Redis, health: RedisHealth, flush_s: float = 0.5) -> None:
        super().__init__(flush_s)
        self.client = client
        self.health = health
        self._counts: Counter[tuple[str, str]] = Counter()

    def watch(self, deployment: str, deadlines_ms: tuple[float, ...], started: float) -> TtftWatch:
        """Judge one request sent at `started` (time.perf_counter) against each deadline."""
        return TtftWatch(self, deployment, deadlines_ms, started)

    def count(self, deployment: str, deadline_ms: float, good: bool) -> None:
        minute, second = divmod(int(clock.now()), 60)
        self._counts[(ttft_verdicts_key(deployment, minute), ttft_verdict_field(deadline_ms, second, good))] += 1

    async def flush(self) -> None:
        counts, self._counts = self._counts, Counter()
        if not counts or not self.health.worth_trying():
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for (key, field), n in counts.items():
                    pipe.hincrby(key, field, n)
                for key in {key for key, _ in counts}:
                    pipe.expire(key, TTFT_VERDICTS_TTL_S)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)
            return
        self.health.mark_up()


class TtftWatch:
    """One request's deadlines: a timer each, cancelled by the first token or the request's end
    (a request that ends before both is left to its usage event)."""

    def __init__(self, verdicts: TtftVerdicts, deployment: str, deadlines_ms: tuple[float, ...],
                 started: float) -> None:
        self.verdicts, self.deployment, self.started = verdicts, deployment, started
        loop = asyncio.get_running_loop()
        elapsed_s = time.perf_counter() - started
        self._pending = {deadline: loop.call_later(max(0.0, deadline / 1000 - elapsed_s), self._late, deadline)
                         for deadline in deadlines_ms}

    def _late(self, deadline_ms: float) -> None:
        if self._pending.pop(deadline_ms, None) is not None:
            self.verdicts.count(self.deployment, deadline_ms, good=False)

    def first_token(self, at: float) -> None:
        """The first token came at `at` (time.perf_counter): a verdict for each deadline still open."""
        ttft_ms = (at - self.started) * 1000
        for deadline, timer in self._pending.items():
            timer.cancel()
            self.verdicts.count(self.deployment, deadline, good=ttft_ms <= deadline)
        self._pending = {}

    def close(self) -> None:
        for timer in self._pending.values():
            timer.cancel()
        self._pending = {}
