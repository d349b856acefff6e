"""Autoscaling between min_replicas and max_replicas on queue depth and KV-cache usage.

The decision is a pure function of per-minute load (from the scraped minute rows), so it is
tested exactly. A stabilisation window keeps it from flapping: scale up only when every minute
of the last `up_window` was overloaded, down only when every minute of the (longer)
`down_window` was idle, and never again before the cooldown since the last change.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Avg, Count, Sum

from deployments.models import Deployment, ReplicaMetricsMinute
from inferops.audit import audit_record


@dataclass(frozen=True)
class MinuteLoad:
    start: datetime
    waiting_per_replica: float   # requests queued per replica
    kv_cache_usage: float        # 0..1, mean over replicas


@dataclass(frozen=True)
class Policy:
    up_waiting_per_replica: float = 2.0
    up_kv_cache_usage: float = 0.85
    down_waiting_per_replica: float = 0.0
    down_kv_cache_usage: float = 0.30
    up_window: timedelta = timedelta(minutes=2)
    down_window: timedelta = timedelta(minutes=5)
    up_cooldown: timedelta = timedelta(minutes=1)
    down_cooldown: timedelta = timedelta(minutes=5)


def covering(minutes: list[MinuteLoad], window: timedelta, now: datetime) -> list[MinuteLoad] | None:
    """The complete minutes inside the window, or None when some minute has no data."""
    needed = int(window.total_seconds() // 60)
    last_complete = now.replace(second=0, microsecond=0) - timedelta(minutes=1)
    wanted = {last_complete - timedelta(minutes=i) for i in range(needed)}
    found = [m for m in minutes if m.start in wanted]
    return found if len(found) == needed else None


def decide(*, current: int, minimum: int, maximum: int, minutes: list[MinuteLoad],
           last_scaled_at: datetime | None, now: datetime, policy: Policy = Policy(),
           boost: int = 0) -> tuple[int, str]:
    """The replica count to run now, and why (empty reason = no change). `boost`: replicas a
    degradation level asks for above min_replicas, within max_replicas; when it ends, the usual
    idle rule scales back down."""
    floor = min(maximum, minimum + boost)
    if current < floor:
        return floor, (f"degradation asks for {boost} more than min_replicas ({minimum})" if floor > minimum
                       else f"below min_replicas ({minimum})")
    minimum = floor
    if current > maximum:
        return maximum, f"above max_replicas ({maximum})"
    since_change = now - last_scaled_at if last_scaled_at else None
    recent_up = covering(minutes, policy.up_window, now)
    if current < maximum and recent_up and (since_change is None or since_change >= policy.up_cooldown):
        if all(m.waiting_per_replica > policy.up_waiting_per_replica or m.kv_cache_usage > policy.up_kv_cache_usage
               for m in recent_up):
            return current + 1, (f"queue or KV cache high for {policy.up_window.total_seconds() / 60:.0f} min "
                                 f"(last: {recent_up[-1].waiting_per_replica:.1f} waiting/replica, "
                                 f"KV {recent_up[-1].kv_cache_usage:.0%})")
    recent_down = covering(minutes, policy.down_window, now)
    if current > minimum and recent_down and (since_change is None or since_change >= policy.down_cooldown):
        if all(m.waiting_per_replica <= policy.down_waiting_per_replica
               and m.kv_cache_usage < policy.down_kv_cache_usage for m in recent_down):
            return current - 1, f"idle for {policy.down_window.total_seconds() / 60:.0f} min"
    return current, ""


def recent_load(deployment: Deployment, now: datetime, window: timedelta) -> list[MinuteLoad]:
    rows = (ReplicaMetricsMinute.objects
            .filter(deployment=deployment, start__gte=now - window - timedelta(minutes=2))
            .values("start")
            .annotate(waiting=Sum("waiting_avg"), kv=Avg("kv_cache_usage_avg"),
                      replicas=Count("replica", distinct=True)))
    return [MinuteLoad(row["start"], row["waiting"] / max(row["replicas"], 1), row["kv"]) for row in rows]


def autoscale(deployment: Deployment, now: datetime, policy: Policy = Policy()) -> str:
    """Apply one decision to the deployment row; returns the reason when it changed."""
    minutes = recent_load(deployment, now, max(policy.up_window, policy.down_window))
    boost = int((deployment.degradation or {}).get("scale_up") or 0)
    target, reason = decide(current=deployment.replicas, minimum=deployment.min_replicas,
                            maximum=deployment.max_replicas, minutes=minutes,
                            last_scaled_at=deployment.last_scaled_at, now=now, policy=policy, boost=boost)
    if target == deployment.replicas:
        return ""
    with transaction.atomic():
        before = {"replicas": deployment.replicas}
        Deployment.objects.filter(pk=deployment.pk).update(replicas=target, last_scaled_at=now)
        deployment.replicas, deployment.last_scaled_at = target, now
        audit_record(actor=None, action="deployment.autoscale", obj=deployment, before=before,
                     after={"replicas": target, "reason": reason})
    return reason
