"""The control plane's Redis connection (REDIS_URL): routes, keys, usage, heartbeats."""

from __future__ import annotations

import redis
from django.conf import settings


def redis_client(timeout_s: float = 3) -> redis.Redis:
    """A client that fails within timeout_s instead of hanging a request or a task on a dead Redis."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
