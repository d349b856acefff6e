"""The gateway's wall clock, set by Redis's: a gateway whose host clock is minutes off (a VM without
NTP) still dates its usage events, heartbeats and TTFT verdicts, and judges keys' expiry, by the
clock every other gateway and the control plane share. Rate-limit windows already read Redis's
`TIME` inside their scripts (limits.py).

Each heartbeat measures the offset with one `TIME` round trip (taken at its midpoint); while Redis
is down the last offset holds.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

# A round trip slower than this says little about the offset: keep the last one.
MAX_ROUND_TRIP_S = 0.5
# An offset this large is worth a warning: the host's clock needs fixing.
WARN_OFFSET_S = 2.0

offset_s = 0.0


def now() -> float:
    """Seconds since the epoch by Redis's clock (the host's until the first measurement)."""
    return time.time() + offset_s


async def sync(redis) -> None:
    """Measure the offset of this host's clock from Redis's."""
    global offset_s
    try:
        before = time.time()
        seconds, micros = await redis.time()
        after = time.time()
    except (RedisError, OSError) as exc:
        logger.debug("clock not synced with redis: %s", exc)
        return
    if after - before > MAX_ROUND_TRIP_S:
        return
    measured = seconds + micros / 1e6 - (before + after) / 2
    if abs(measured) >= WARN_OFFSET_S and abs(measured - offset_s) >= WARN_OFFSET_S:
        logger.warning("this host's clock is %.1f s %s Redis's: the gateway dates everything by Redis's",
                       abs(measured), "behind" if measured > 0 else "ahead of")
    offset_s = measured
