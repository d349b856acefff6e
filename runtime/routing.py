"""The routing table the gateway reads: deployment -> version weights -> ready replica URLs.

Published to Redis (hash `inferops:routing`, one JSON document per deployment) by the reconcile
loop after every change, with a monotonically increasing `inferops:routing:generation` and a
message on `inferops:routing:changed` so gateways can refresh at once instead of on their next
poll. Gateways keep their last copy in memory, so serving continues when the control plane is
down.
"""

from __future__ import annotations

import json
import time

import redis
from django.conf import settings

ROUTING_KEY = "inferops:routing"
GENERATION_KEY = "inferops:routing:generation"
CHANGED_CHANNEL = "inferops:routing:changed"


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=3, socket_connect_timeout=3)


def routing_entry(deployment, ready_replicas, weights: dict[int, int] | None = None) -> dict:
    """Versions with their ready replicas; weights by version number (percent).

    Without explicit weights (no rollout running) each version's share follows its number of
    ready replicas, so a rolling replacement shifts traffic as new replicas become ready.
    """
    by_version: dict[int, list] = {}
    for replica in ready_replicas:
        by_version.setdefault(replica.version.number, []).append({"id": replica.pk, "url": replica.url})
    total = sum(len(replicas) for replicas in by_version.values())
    versions = []
    for number, replicas in sorted(by_version.items()):
        weight = weights.get(number, 0) if weights is not None else round(100 * len(replicas) / total)
        versions.append({"version": number, "weight": weight, "replicas": replicas})
    return {
        "deployment": deployment.name,
        "model": deployment.model.name,
        "task": deployment.model.task,
        "backend": deployment.backend,
        "versions": versions,
        "published_at": time.time(),
    }


def publish(entry: dict) -> None:
    client = redis_client()
    with client.pipeline() as pipe:
        pipe.hset(ROUTING_KEY, entry["deployment"], json.dumps(entry))
        pipe.incr(GENERATION_KEY)
        pipe.publish(CHANGED_CHANNEL, entry["deployment"])
        pipe.execute()


def unpublish(name: str) -> None:
    client = redis_client()
    with client.pipeline() as pipe:
        pipe.hdel(ROUTING_KEY, name)
        pipe.incr(GENERATION_KEY)
        pipe.publish(CHANGED_CHANNEL, name)
        pipe.execute()


def read_table() -> dict[str, dict]:
    raw = redis_client().hgetall(ROUTING_KEY)
    return {key.decode(): json.loads(value) for key, value in raw.items()}
