"""The control plane's Redis connection (REDIS_URL): routes, keys, usage, heartbeats."""

from __future__ import annotations

import redis
from django.conf import settings


def redis_client(timeout_s: float = 3) -> redis.Redis:
    """A client that fails within timeout_s instead of hanging a request or a task on a dead Redis."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def replace_table(key: str, generation_key: str, channel: str, table: dict[str, str], message: str) -> None:
    """Replace a published hash whole, move its generation on and announce it, in one transaction: the
    gateways' copy (runtime/gateway/state.py) follows on the message, or on the generation they poll."""
    with redis_client().pipeline(transaction=True) as pipe:
        pipe.delete(key)
        if table:
            pipe.hset(key, mapping=table)
        pipe.incr(generation_key)
        pipe.publish(channel, message)
        pipe.execute()
