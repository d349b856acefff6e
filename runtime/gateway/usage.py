"""Usage events: one per request, to the usage stream of the Redis contract, never lost.

Requests only append to an in-memory queue; one writer task sends what has gathered in one
pipelined XADD batch, so a busy gateway pays one round trip per batch rather than per request.
When Redis fails, the batch goes to a local spool file (one JSON per line) and so does every
later event until the spool has been replayed in order, after which the file is truncated. When
the spool's disk is full too, events wait in memory (bounded) until either takes them.
A crash between the replay and the truncation replays some events twice; ingestion is
idempotent by request_id, so that costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from runtime.gateway.contract import USAGE_STREAM
from runtime.gateway.state import RedisHealth

logger = logging.getLogger(__name__)

STREAM_MAXLEN = 1_000_000
BATCH_SIZE = 500
# Events kept in memory while neither Redis nor the spool (a full disk) takes them: about 0.5 KB each.
HELD_MAX = 200_000


class BackgroundWriter:
    """A writer task: requests only gather in memory; `flush` sends what gathered when woken or every
    `interval_s`, and once more on stop, so a clean shutdown loses nothing."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._ready.wait()
            self._ready.clear()
            await self.flush()

    async def flush(self) -> None:
        raise NotImplementedError


class UsageSink(BackgroundWriter):
    def __init__(self, client: aioredis.Redis, spool_path: Path, health: RedisHealth,
                 on_spool_depth: Any = None, replay_interval_s: float = 1.0) -> None:
        super().__init__(replay_interval_s)
        self.client = client
        self.spool_path = spool_path
        self.health = health
        self._on_spool_depth = on_spool_depth or (lambda depth: None)
        self._queue: list[str] = []
        self.held_since_error = False
        spool_path.parent.mkdir(parents=True, exist_ok=True)
        self.spool_depth = self._count_spooled()
        self._on_spool_depth(self.spool_depth)

    def emit(self, event: dict[str, Any]) -> None:
        self._queue.append(json.dumps(event, separators=(",", ":")))
        self._ready.set()

    async def flush(self) -> None:
        """Sends what is queued to Redis, or to the spool while Redis is down or the spool not replayed."""
        if self.spool_depth and self.health.worth_trying():
            await self._replay()
        batch, self._queue = self._queue, []
        if not batch:
            return
        # While older events wait in the spool, newer ones queue behind them to keep the order.
        if self.spool_depth or not self.health.worth_trying() or not await self._send(batch):
            self._spool(batch)

    async def _send(self, lines: list[str]) -> bool:
        try:
            for start in range(0, len(lines), BATCH_SIZE):
                async with self.client.pipeline(transaction=False) as pipe:
                    for line in lines[start:start + BATCH_SIZE]:
                        pipe.xadd(USAGE_STREAM, {"e": line}, maxlen=STREAM_MAXLEN, approximate=True)
                    await pipe.execute()
        except (RedisError, OSError) as exc:
            self.health.mark_down(exc)
            # A batch that failed half way is spooled whole: the replay may duplicate events,
            # which ingestion drops by request_id; dropping them instead would lose usage.
            return False
        self.health.mark_up()
        return True

    def _spool(self, lines: list[str]) -> None:
        """Append `lines` to the spool. When it cannot be written (a full disk), they wait in memory
        ahead of newer events, up to HELD_MAX, and the file is cut back to its last whole line."""
        data = "".join(line + "\n" for line in lines).encode()
        try:
            descriptor = os.open(self.spool_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                whole = os.fstat(descriptor).st_size
                try:
                    written = 0
                    while written < len(data):
                        written += os.write(descriptor, data[written:])
                except OSError:
                    os.ftruncate(descriptor, whole)
                    raise
            finally:
                os.close(descriptor)
        except OSError as exc:
            self._hold(lines, exc)
            return
        if self.held_since_error:
            logger.warning("usage spool writable again after holding events in memory")
            self.held_since_error = False
        self.spool_depth += len(lines)
        self._on_spool_depth(self.spool_depth)

    def _hold(self, lines: list[str], exc: OSError) -> None:
        room = max(0, HELD_MAX - len(self._queue))
        self._queue[:0] = lines[:room]
        if len(lines) > room:
            logger.error("usage spool unwritable and %d events already held in memory: %d events dropped",
                         HELD_MAX, len(lines) - room)
        if not self.held_since_error:
            logger.error("usage spool %s cannot be written (%s): events wait in memory until it or Redis can "
                         "take them", self.spool_path, exc)
            self.held_since_error = True

    async def _replay(self) -> None:
        lines = [line for line in self.spool_path.read_text(encoding="utf-8").splitlines() if _is_event(line)]
        if lines and not await self._send(lines):
            return
        logger.warning("replayed %d spooled usage events", len(lines))
        self.spool_path.write_text("", encoding="utf-8")
        self.spool_depth = 0
        self._on_spool_depth(0)

    def _count_spooled(self) -> int:
        if not self.spool_path.exists():
            return 0
        with self.spool_path.open(encoding="utf-8") as spool:
            return sum(1 for line in spool if line.strip())


def _is_event(line: str) -> bool:
    """False for blank lines and for the torn last line of a gateway killed mid-write."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        if line.strip():
            logger.error("skipping a torn spool line: %.80s", line)
        return False
