"""The replica-hour ledger: replica runs observed, priced minute by minute, rolled up hourly; and
the usage ledger rolled up hourly beside it, with the tokens of SLO-compliant requests.

`ledger_sync(now)` is the whole beat job (every minute, so the ledger is at most two minutes
behind). Each step is a recomputation, never an increment:
1. `lives_sync` records each run of each replica (`ReplicaLife`): a replica row is reused across
   restarts, so its runs are only known to someone who looks while they happen.
2. `costs_compute(start, end)` deletes and rewrites the `CostHour` rows of [start, end) from the
   runs and the price book, so re-running a period changes nothing.
3. `usage_changes` claims the hours the usage pipeline added to since the last sync (it writes
   `UsageHour` in each ingest transaction, costing/usage.py), late ones included, so that late
   usage of a closed month is booked as an adjustment.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q

from costing.choices import Tier
from costing.models import CostHour, LedgerState, Price, ReplicaLife
from deployments.choices import DriverName, ReplicaState
from deployments.models import Deployment, Replica
from inferops.locks import LockId, try_advisory_lock
from slo.budget import OVERLAP, floor_minute

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
HOUR = timedelta(hours=1)
LOCK_NAMESPACE = LockId.COSTING_LEDGER
RUNNING = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING)
GIB = Decimal(2**30)
SIXTY = Decimal(60)


def ceil_minute(t: datetime) -> datetime:
    floor = floor_minute(t)
    return floor if floor == t else floor + MINUTE


def floor_hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


# ---------------------------------------------------------------------------- what a replica holds


@dataclass(frozen=True)
class Held:
    gpu_type: str
    gpu_count: int
    cpus: Decimal
    memory_gib: Decimal
    derived: str


def _quantity(value) -> Decimal:
    from kubernetes.utils import parse_quantity

    return Decimal(parse_quantity(str(value)))


def local_default_cpus() -> Decimal:
    configured = getattr(settings, "INFEROPS_COST_LOCAL_CPUS", 0)
    return Decimal(configured or os.cpu_count() or 1)


def replica_resources(deployment, replica) -> Held:
    """What a replica is charged for: the deployment's `resources` where given. A local replica
    without a cpu figure is charged for the CPU threads it is given: the built-in engine's
    `cpu_threads` engine argument, else every core of the host (torch's default, and vLLM's)."""
    resources = deployment.resources or {}
    gpu_count = int(resources.get("gpu_count") or 0)
    gpu_type = str(resources.get("gpu_type") or "") if gpu_count else ""
    derived = []
    if resources.get("cpu") not in (None, ""):
        cpus = _quantity(resources["cpu"])
        derived.append("cpu from resources")
    elif replica.driver == DriverName.LOCAL:
        threads = (replica.engine_args or {}).get("cpu_threads")
        if threads:
            cpus = Decimal(int(threads))
            derived.append("cpu from engine_args.cpu_threads")
        else:
            cpus = local_default_cpus()
            derived.append("cpu = the host's cores (no cpu_threads)")
    else:
        cpus = Decimal(0)
        derived.append("no cpu request")
    memory = _quantity(resources["memory"]) / GIB if resources.get("memory") else Decimal(0)
    if memory:
        derived.append("memory from resources")
    if gpu_count:
        derived.append("gpus from resources")
    return Held(gpu_type, gpu_count, cpus.quantize(Decimal("0.001")), memory.quantize(Decimal("0.0001")),
                "; ".join(derived))


def resources_held() -> set[str]:
    """Every price resource (`cpu`, `memory`, `gpu:<type>`, `node:<name>`) that a deployment's
    replicas would hold now, or that a recorded replica run held: a price of anything else charges
    nothing."""
    held = set()
    for deployment in Deployment.objects.only("driver", "resources", "engine_args"):
        would = replica_resources(deployment, SimpleNamespace(driver=deployment.driver,
                                                              engine_args=deployment.engine_args))
        held.update(name for name, used in ((f"gpu:{would.gpu_type}", would.gpu_type), ("cpu", would.cpus),
                                            ("memory", would.memory_gib)) if used)
    runs = ReplicaLife.objects
    held.update(f"gpu:{gpu}" for gpu in runs.filter(gpu_count__gt=0).values_list("gpu_type", flat=True).distinct())
    held.update(name for name, used in (("cpu", runs.filter(cpus__gt=0).exists()),
                                        ("memory", runs.filter(memory_gib__gt=0).exists())) if used)
    nodes = set(runs.values_list("node", flat=True).distinct()) | set(
        Replica.objects.values_list("node", flat=True).distinct())
    held.update(f"node:{node}" for node in nodes if node)
    return held


# ---------------------------------------------------------------------------- replica runs


def _run_end(replica: Replica, life: ReplicaLife) -> datetime | None:
    """When this run ended, or None while it goes on."""
    if replica.started_at != life.started_at:
        # The row was restarted before we saw this run end: it ran at least until last seen.
        return life.seen_until
    if replica.state in RUNNING:
        return None
    if replica.state == ReplicaState.STOPPED and replica.stopped_at:
        return max(replica.stopped_at, life.started_at)
    # FAILED: marked so (its process gone) at its last save.
    return max(replica.updated_at, life.started_at)


def lives_sync(now: datetime, since: datetime | None) -> datetime | None:
    """Record replica runs as of `now`; return the earliest time whose cost changed (or None)."""
    open_lives = {life.replica_ref: life for life in ReplicaLife.objects.filter(ended_at__isnull=True)}
    # The first run takes every replica's last run (the history a row still tells); later runs
    # look at running replicas, open runs, and rows changed since the last look.
    changed = Q(state__in=RUNNING) | Q(pk__in=list(open_lives)) | Q(updated_at__gte=since - OVERLAP) if since else Q()
    replicas = list(Replica.objects.filter(changed, started_at__isnull=False)
                    .select_related("deployment", "deployment__model", "version"))
    known = {(life.replica_ref, life.started_at): life for life in ReplicaLife.objects.filter(
        replica_ref__in=[r.pk for r in replicas], started_at__in=[r.started_at for r in replicas])}
    earliest: datetime | None = None

    def touch(t: datetime) -> None:
        nonlocal earliest
        earliest = t if earliest is None else min(earliest, t)

    with transaction.atomic():
        seen_refs = set()
        for replica in replicas:
            seen_refs.add(replica.pk)
            previous = open_lives.get(replica.pk)
            if previous is not None and previous.started_at != replica.started_at:
                previous.ended_at = previous.seen_until
                previous.save(update_fields=["ended_at"])
                touch(previous.seen_until)
            life = known.get((replica.pk, replica.started_at))
            if life is None:
                held = replica_resources(replica.deployment, replica)
                life = ReplicaLife(
                    replica=replica, replica_ref=replica.pk, deployment=replica.deployment.name,
                    version=replica.version.number, model=replica.deployment.model.name, driver=replica.driver,
                    node=replica.node, started_at=replica.started_at, seen_until=max(now, replica.started_at),
                    gpu_type=held.gpu_type, gpu_count=held.gpu_count, cpus=held.cpus, memory_gib=held.memory_gib,
                    resources_from=held.derived,
                )
                life.ended_at = _run_end(replica, life)
                life.save()
                touch(life.started_at)
                continue
            if life.ended_at is not None:
                continue
            ended = _run_end(replica, life)
            if ended is None:
                life.seen_until = max(now, life.seen_until)
                life.save(update_fields=["seen_until"])
            else:
                life.ended_at = ended
                life.save(update_fields=["ended_at"])
                touch(min(ended, life.seen_until))
        # Open runs whose replica row is gone (its deployment was deleted): they ran until last seen.
        for ref, life in open_lives.items():
            if ref not in seen_refs and not Replica.objects.filter(pk=ref).exists():
                life.ended_at = life.seen_until
                life.save(update_fields=["ended_at"])
                touch(life.seen_until)
    return earliest


# ---------------------------------------------------------------------------- pricing


class PriceBook:
    """Prices by resource, each resolved at a minute: the preferred tier's, else the next tier's."""

    def __init__(self, prices: list[Price], preferred_tier: str):
        order = [preferred_tier, *[t for t in Tier.values if t != preferred_tier]]
        self.rank = {tier: i for i, tier in enumerate(order)}
        self.by_resource: dict[str, list[tuple[datetime, datetime | None, int, Decimal]]] = defaultdict(list)
        for price in prices:
            end = ceil_minute(price.effective_to) if price.effective_to else None
            self.by_resource[price.resource].append(
                (ceil_minute(price.effective_from), end, self.rank.get(price.tier, 99), price.usd_per_hour))

    @classmethod
    def load(cls) -> PriceBook:
        return cls(list(Price.objects.all()), getattr(settings, "INFEROPS_COST_TIER", Tier.ON_DEMAND))

    def has(self, resource: str) -> bool:
        return resource in self.by_resource

    def at(self, resource: str, t: datetime) -> Decimal:
        best = None
        for start, end, rank, usd in self.by_resource.get(resource, ()):
            if start <= t and (end is None or t < end) and (best is None or rank < best[0]):
                best = (rank, usd)
        return best[1] if best else Decimal(0)

    def changes(self, resource: str) -> list[datetime]:
        points = []
        for start, end, _, _ in self.by_resource.get(resource, ()):
            points.append(start)
            if end is not None:
                points.append(end)
        return points


def billed_span(life: ReplicaLife, until: datetime) -> tuple[datetime, datetime]:
    """Whole minutes: a minute the process held its resources in at all is charged."""
    end = life.ended_at if life.ended_at is not None else life.seen_until
    return floor_minute(life.started_at), min(ceil_minute(end), until)


@dataclass
class HourCost:
    minutes: int = 0
    gpu: Decimal = Decimal(0)
    cpu: Decimal = Decimal(0)
    memory: Decimal = Decimal(0)
    node: Decimal = Decimal(0)


def _node_counts(spans: list[tuple[datetime, datetime]]):
    """(times, counts): how many runs hold the node from each time on."""
    deltas: dict[datetime, int] = defaultdict(int)
    for start, end in spans:
        if end > start:
            deltas[start] += 1
            deltas[end] -= 1
    times, counts, running = [], [], 0
    for t in sorted(deltas):
        running += deltas[t]
        times.append(t)
        counts.append(running)
    return times, counts


def life_costs(life: ReplicaLife, start: datetime, end: datetime, book: PriceBook,
               node_share=None) -> dict[datetime, HourCost]:
    """The cost of one run in [start, end), per hour, from constant-price pieces."""
    first, last = billed_span(life, end)
    first = max(first, start)
    if last <= first:
        return {}
    gpu_resource = f"gpu:{life.gpu_type}" if life.gpu_count else None
    node_resource = f"node:{life.node}"
    points = {first, last}
    hour = floor_hour(first) + HOUR
    while hour < last:
        points.add(hour)
        hour += HOUR
    for resource in (gpu_resource, "cpu", "memory", node_resource):
        if resource:
            points.update(t for t in book.changes(resource) if first < t < last)
    if node_share is not None:
        points.update(t for t in node_share[0] if first < t < last)
    cuts = sorted(points)
    hours: dict[datetime, HourCost] = {}
    for a, b in zip(cuts, cuts[1:], strict=False):
        minutes = int((b - a) / MINUTE)
        cost = hours.setdefault(floor_hour(a), HourCost())
        cost.minutes += minutes
        share = Decimal(minutes) / SIXTY  # hours
        if gpu_resource:
            cost.gpu += book.at(gpu_resource, a) * life.gpu_count * share
        cost.cpu += book.at("cpu", a) * life.cpus * share
        cost.memory += book.at("memory", a) * life.memory_gib * share
        if node_share is not None:
            times, counts = node_share
            sharing = counts[bisect_right(times, a) - 1]
            cost.node += book.at(node_resource, a) * share / max(sharing, 1)
    return hours


def costs_compute(start: datetime, end: datetime, book: PriceBook | None = None) -> int:
    """Rewrite every CostHour row of [start, end) (start on an hour) from the runs and prices."""
    book = book or PriceBook.load()
    lives = list(ReplicaLife.objects.filter(started_at__lt=end).filter(
        Q(ended_at__isnull=True, seen_until__gte=start) | Q(ended_at__gte=start)))
    by_node: dict[str, list[ReplicaLife]] = defaultdict(list)
    for life in lives:
        by_node[life.node].append(life)
    shares = {node: _node_counts([billed_span(life, end) for life in group])
              for node, group in by_node.items() if book.has(f"node:{node}")}
    rows = []
    for life in lives:
        for hour, cost in life_costs(life, start, end, book, shares.get(life.node)).items():
            if not cost.minutes:
                continue
            rows.append(CostHour(
                life=life, hour=hour, deployment=life.deployment, version=life.version, model=life.model,
                minutes=cost.minutes, gpu_usd=cost.gpu, cpu_usd=cost.cpu, memory_usd=cost.memory,
                node_usd=cost.node, usd=cost.gpu + cost.cpu + cost.memory + cost.node,
            ))
    with transaction.atomic():
        CostHour.objects.filter(hour__gte=start, hour__lt=end).delete()
        CostHour.objects.bulk_create(rows, batch_size=2000)
    return len(rows)


# ---------------------------------------------------------------------------- usage changes


def usage_changes() -> list[tuple[str, datetime]]:
    """(deployment, hour) of the UsageHour rows the usage pipeline added to since the last call.

    The UPDATE waits for a batch that holds a row and then sees its change; a batch after it
    marks the row again for the next call: no change is missed or claimed twice."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE costing_usagehour SET changed = false WHERE changed RETURNING deployment, hour")
        return sorted(set(cursor.fetchall()))


# ---------------------------------------------------------------------------- the beat job


@dataclass
class SyncReport:
    skipped: bool = False
    cost_from: str | None = None
    cost_rows: int = 0
    usage_keys: int = 0
    earliest_change: datetime | None = None

    def as_dict(self) -> dict:
        data = dict(self.__dict__)
        data["earliest_change"] = self.earliest_change.isoformat() if self.earliest_change else None
        return data


def ledger_sync(now: datetime) -> SyncReport:
    """Bring the ledger up to `now` (to its last full minute); safe to run twice, or at once."""
    report = SyncReport()
    with try_advisory_lock(LOCK_NAMESPACE) as acquired:
        if not acquired:
            report.skipped = True
            return report
        state, _ = LedgerState.objects.get_or_create(pk=1)
        until = floor_minute(now)
        earliest = lives_sync(now, state.cost_through)
        start_points = [t for t in (state.cost_through, earliest) if t is not None]
        if not start_points:
            first = ReplicaLife.objects.order_by("started_at").values_list("started_at", flat=True).first()
            start_points = [first or until]
        start = floor_hour(min(start_points))
        report.cost_from = start.isoformat()
        report.cost_rows = costs_compute(start, until)
        keys = usage_changes()
        report.usage_keys = len(keys)
        report.earliest_change = min([start, *(hour for _, hour in keys)])
        LedgerState.objects.filter(pk=1).update(cost_through=until)
    return report


def ledger_through() -> datetime | None:
    state = LedgerState.objects.filter(pk=1).first()
    return state.cost_through if state else None
