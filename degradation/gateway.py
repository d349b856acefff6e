"""Degradation and the gateways, through Redis (runtime/gateway/contract.py): the level in force and
the TTFT deadlines published the moment they change, and the gateways' early TTFT verdicts read back.

The routing table carries the level too, from the next reconcile pass: it heals a publish lost
here (Redis down), since a gateway applies whichever of the two was published later.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from django.db import transaction
from redis.exceptions import RedisError

from deployments.replicas.routing import gateway_degradation
from inferops.redis_client import redis_client
from runtime.gateway.contract import (
    DEGRADATION_CHANNEL,
    DEGRADATION_GENERATION_KEY,
    DEGRADATION_KEY,
    ttft_verdicts_key,
)
from slo.budget import Counts
from slo.choices import Budgeting, Scope, SliKind

log = logging.getLogger(__name__)


def ttft_deadlines(slos) -> list[float]:
    """The TTFT thresholds among `slos` that the gateways can judge early (see early_judged)."""
    return sorted({slo.ttft_ms for slo in slos if early_judged(slo)})


def early_judged(slo) -> bool:
    """A TTFT SLO over all of a deployment's requests, budgeted by requests: a gateway's verdicts at
    the first token say how it burns. (A tenant's SLO counts only that tenant's requests, and a
    timeslice budget counts bad minutes: both wait for the usage events.)"""
    return (slo.ttft_ms is not None and slo.sli_kind in (SliKind.LATENCY, SliKind.GOODPUT)
            and slo.scope != Scope.TENANT and slo.budgeting == Budgeting.OCCURRENCES)


def entry(actions: dict | None, deadlines: list[float]) -> dict:
    return {"degradation": gateway_degradation(actions), "ttft_deadlines_ms": deadlines}


def published() -> dict[str, dict]:
    """The published entries, without their publish times (to compare with what should be)."""
    raw = redis_client().hgetall(DEGRADATION_KEY)
    entries = {}
    for name, value in raw.items():
        data = json.loads(value)
        entries[name.decode()] = {"degradation": data.get("degradation"),
                                  "ttft_deadlines_ms": data.get("ttft_deadlines_ms") or []}
    return entries


def publish(name: str, document: dict) -> bool:
    """Put a deployment's entry in force now; False (logged) when Redis failed."""
    try:
        with redis_client().pipeline() as pipe:
            pipe.hset(DEGRADATION_KEY, name, json.dumps({**document, "published_at": time.time()}))
            pipe.incr(DEGRADATION_GENERATION_KEY)
            pipe.publish(DEGRADATION_CHANNEL, name)
            pipe.execute()
    except (RedisError, OSError) as exc:
        log.warning("degradation of %s not published (the next reconcile pass carries it): %s", name, exc)
        return False
    return True


def publish_on_commit(name: str, document: dict) -> None:
    transaction.on_commit(lambda: publish(name, document))


@dataclass(frozen=True)
class EarlyWindow:
    """The gateways' verdicts in the `seconds` before `now` (Unix seconds)."""

    now: float
    seconds: float

    def minutes(self) -> range:
        return range(int(self.now - self.seconds) // 60, int(self.now) // 60 + 1)

    def holds(self, minute: int, second: int) -> bool:
        return self.now - self.seconds < minute * 60 + second + 1 and minute * 60 + second <= self.now


def early_counts(deployment: str, deadlines: list[float], window: EarlyWindow) -> dict[float, Counts]:
    """deadline -> (good, total) of the deployment's early TTFT verdicts in the window."""
    client = redis_client()
    with client.pipeline(transaction=False) as pipe:
        for minute in window.minutes():
            pipe.hgetall(ttft_verdicts_key(deployment, minute))
        hashes = pipe.execute()
    good = dict.fromkeys(deadlines, 0)
    total = dict.fromkeys(deadlines, 0)
    for minute, fields in zip(window.minutes(), hashes, strict=True):
        for name, value in fields.items():
            deadline_text, second, verdict = name.decode().split(":")
            deadline = float(deadline_text)
            if deadline in total and window.holds(minute, int(second)):
                total[deadline] += int(value)
                good[deadline] += int(value) if verdict == "good" else 0
    return {deadline: Counts(good[deadline], total[deadline]) for deadline in deadlines}
