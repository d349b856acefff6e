"""Each gateway announces itself in Redis (contract.GATEWAYS_KEY) so the control plane can list
gateways for Prometheus' service discovery; nothing else registers them.

The entry carries the wall-clock time of its last beat; readers ignore entries older than
GATEWAY_STALE_S, so a gateway that died without saying goodbye drops out by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging

from redis.exceptions import RedisError

from runtime.gateway import clock
from runtime.gateway.contract import GATEWAY_HEARTBEAT_S, GATEWAYS_KEY

logger = logging.getLogger(__name__)


def gateway_entry(instance: str, address: str) -> str:
    return json.dumps({"instance": instance, "address": address, "metrics_path": "/metrics",
                       "seen_at": clock.now()})


async def beat(redis, instance: str, address: str) -> None:
    """Refresh this gateway's entry (and its clock's offset) until cancelled; a Redis outage only
    delays the next beat."""
    while True:
        await clock.sync(redis)
        try:
            await redis.hset(GATEWAYS_KEY, instance, gateway_entry(instance, address))
        except (RedisError, OSError) as exc:
            logger.debug("gateway heartbeat failed: %s", exc)
        await asyncio.sleep(GATEWAY_HEARTBEAT_S)


async def leave(redis, instance: str) -> None:
    try:
        await redis.hdel(GATEWAYS_KEY, instance)
    except (RedisError, OSError) as exc:
        logger.debug("gateway could not deregister: %s", exc)
