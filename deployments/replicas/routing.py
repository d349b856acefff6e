"""The routing table the gateway reads: deployment -> version weights -> ready replica URLs.

Published to Redis (the routing hash of runtime/gateway/contract.py, one JSON document per
deployment) by the reconcile loop after every change, with a monotonically increasing generation
and a message on the routing channel so gateways can refresh at once instead of on their next
poll. Gateways keep their last copy in memory, so serving continues when the control plane is
down.
"""

from __future__ import annotations

import json
import time

from inferops.redis_client import redis_client
from runtime.gateway.contract import (
    DEFAULT_HOLD_MAX_QUEUE,
    DEFAULT_HOLD_MAX_WAIT_S,
    PREVIEW_SUFFIX,
    ROUTING_CHANNEL,
    ROUTING_GENERATION_KEY,
    ROUTING_KEY,
)


def routing_entry(deployment, groups: list[tuple[str, int, int | None, list]], name: str | None = None) -> dict:
    """The table entry for a deployment (or its preview route `name`) from groups of ready replicas.

    Each group is (track, version number, weight percent or None, ready replicas). A rollout gives
    its candidate an explicit weight; groups without one share the rest by their number of ready
    replicas, so with no rollout a rolling replacement shifts traffic as new replicas become ready.
    """
    groups = [group for group in groups if group[3]]
    explicit = sum(weight for _, _, weight, _ in groups if weight is not None)
    implicit = sum(len(replicas) for _, _, weight, replicas in groups if weight is None)
    versions = []
    for track, number, weight, replicas in groups:
        if weight is None:
            weight = round(max(0, 100 - explicit) * len(replicas) / implicit)
        versions.append({"version": number, "track": track, "weight": weight,
                         "replicas": [{"id": r.pk, "url": r.url} for r in replicas]})
    return {
        "deployment": name or deployment.name,
        "model": deployment.model.name,
        "task": deployment.model.task,
        "backend": deployment.backend,
        "versions": versions,
        "published_at": time.time(),
        # A rollout's preview route is for smoke tests: never degraded.
        "degradation": None if name else gateway_degradation(deployment.degradation),
        "scale_from_zero": None if name else scale_from_zero(deployment),
    }


def scale_from_zero(deployment) -> dict | None:
    """What the gateway needs to hold requests for a deployment that may park (min_replicas 0)."""
    if not (deployment.autoscale and deployment.min_replicas == 0):
        return None
    hold = (deployment.autoscaling or {}).get("hold") or {}
    return {"max_wait_s": float(hold.get("max_wait_s", DEFAULT_HOLD_MAX_WAIT_S)),
            "max_queue": int(hold.get("max_queue", DEFAULT_HOLD_MAX_QUEUE))}


def gateway_degradation(actions: dict | None) -> dict | None:
    """The part of the degradation actions in force that the gateway applies."""
    if not actions:
        return None
    keys = ("level", "name", "shed_below_priority", "max_tokens_cap", "fallback", "retry_after_s")
    return {key: actions.get(key) for key in keys}


def preview_name(deployment_name: str) -> str:
    return deployment_name + PREVIEW_SUFFIX


def publish(entry: dict) -> None:
    client = redis_client()
    with client.pipeline() as pipe:
        pipe.hset(ROUTING_KEY, entry["deployment"], json.dumps(entry))
        pipe.incr(ROUTING_GENERATION_KEY)
        pipe.publish(ROUTING_CHANNEL, entry["deployment"])
        pipe.execute()


def unpublish(name: str) -> None:
    client = redis_client()
    with client.pipeline() as pipe:
        pipe.hdel(ROUTING_KEY, name)
        pipe.incr(ROUTING_GENERATION_KEY)
        pipe.publish(ROUTING_CHANNEL, name)
        pipe.execute()


def is_published(name: str) -> bool:
    return bool(redis_client().hexists(ROUTING_KEY, name))


def read_table() -> dict[str, dict]:
    raw = redis_client().hgetall(ROUTING_KEY)
    return {key.decode(): json.loads(value) for key, value in raw.items()}
