"""Hourly roll-ups of replica metrics, and pruning of rows past their retention.

A roll-up recomputes an hour from its minute rows and upserts the hour row, so running it twice,
or on an hour that is still filling, is harmless: the last run wins with the complete answer.
Minute rows are kept `INFEROPS_METRICS_MINUTE_RETENTION_DAYS` (14), hour rows
`INFEROPS_METRICS_HOUR_RETENTION_DAYS` (400).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Min
from django.utils import timezone

from deployments.models import MetricsBucket, ReplicaMetricsHour, ReplicaMetricsMinute
from deployments.replicas.scraping import COUNTERS, GAUGES, HISTOGRAMS, add_counts

HOUR = timedelta(hours=1)
# Hours recomputed on every run even when already rolled up: the current one is still filling
# and the one before may have taken a late sample.
RECOMPUTE_HOURS = 2


def minute_retention() -> timedelta:
    return timedelta(days=getattr(settings, "INFEROPS_METRICS_MINUTE_RETENTION_DAYS", 14))


def hour_retention() -> timedelta:
    return timedelta(days=getattr(settings, "INFEROPS_METRICS_HOUR_RETENTION_DAYS", 400))


def hour_start(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def combine_buckets(rows: Iterable[MetricsBucket], into: MetricsBucket) -> MetricsBucket:
    """Fold per-period rows of one replica into `into`: gauge averages weighted by scrapes,
    maxima of maxima, sums of counter and histogram deltas."""
    rows = list(rows)
    into.scrapes = sum(row.scrapes for row in rows)
    weights = [row.scrapes for row in rows] if into.scrapes else [1] * len(rows)
    for key in GAUGES:
        weighted = sum(getattr(row, f"{key}_avg") * weight
                       for row, weight in zip(rows, weights, strict=True))
        setattr(into, f"{key}_avg", weighted / sum(weights))
        setattr(into, f"{key}_max", max(getattr(row, f"{key}_max") for row in rows))
    for key in COUNTERS:
        setattr(into, key, sum(getattr(row, key) for row in rows))
    into.requests_by_reason, into.slo_scheduling = {}, {}
    for row in rows:
        into.requests_by_reason = add_counts(into.requests_by_reason, row.requests_by_reason)
        into.slo_scheduling = add_counts(into.slo_scheduling, row.slo_scheduling)
    _combine_gpu(rows, into)
    for key in HISTOGRAMS:
        buckets: dict = {}
        for row in rows:
            buckets = add_counts(buckets, getattr(row, f"{key}_buckets"))
        setattr(into, f"{key}_buckets", buckets)
        setattr(into, f"{key}_sum", sum(getattr(row, f"{key}_sum") for row in rows))
        setattr(into, f"{key}_count", sum(getattr(row, f"{key}_count") for row in rows))
    return into


GPU_AVERAGES = ("gpu_util_avg", "gpu_memory_used_avg", "gpu_power_avg", "gpu_sm_clock_avg")
GPU_MAXIMA = ("gpu_devices", "gpu_util_max", "gpu_memory_total", "gpu_temp_max")


def _combine_gpu(rows: list[MetricsBucket], into: MetricsBucket) -> None:
    """GPU averages weighted by the scrapes that carried GPU series, maxima of maxima; periods
    without telemetry weigh nothing (rather than pulling the average towards an idle 0)."""
    measured = [row for row in rows if row.gpu_scrapes]
    into.gpu_scrapes = sum(row.gpu_scrapes for row in measured)
    into.gpu_minutes = sum(row.gpu_minutes for row in measured)
    for column in GPU_AVERAGES:
        weighted = sum(getattr(row, column) * row.gpu_scrapes for row in measured)
        setattr(into, column, weighted / into.gpu_scrapes if measured else 0.0)
    for column in GPU_MAXIMA:
        setattr(into, column, max((getattr(row, column) for row in measured), default=0))


_HOUR_FIELDS = [f.name for f in ReplicaMetricsHour._meta.concrete_fields
                if f.name not in {"id", "replica", "start"}]


def rollup_hour(start: datetime) -> int:
    """Recompute every replica's hour row for the hour beginning at `start`; returns how many."""
    start = hour_start(start)
    by_replica: dict[int, list[ReplicaMetricsMinute]] = defaultdict(list)
    for row in ReplicaMetricsMinute.objects.filter(start__gte=start, start__lt=start + HOUR):
        by_replica[row.replica_id].append(row)
    hours = [
        combine_buckets(rows, ReplicaMetricsHour(
            replica_id=replica_id, deployment_id=rows[0].deployment_id,
            version_id=rows[0].version_id, start=start))
        for replica_id, rows in by_replica.items()
    ]
    with transaction.atomic():
        ReplicaMetricsHour.objects.bulk_create(
            hours, update_conflicts=True, unique_fields=["replica", "start"],
            update_fields=_HOUR_FIELDS)
    return len(hours)


def hours_to_roll_up(now: datetime) -> list[datetime]:
    """The recent hours, plus every hour since the newest hour row (after an outage of the
    roll-up task), never one whose minutes are partly pruned."""
    current = hour_start(now)
    first = current - (RECOMPUTE_HOURS - 1) * HOUR
    newest_rolled = ReplicaMetricsHour.objects.aggregate(newest=Max("start"))["newest"]
    if newest_rolled is None:
        oldest_minute = ReplicaMetricsMinute.objects.aggregate(oldest=Min("start"))["oldest"]
        if oldest_minute is not None:
            first = min(first, hour_start(oldest_minute))
    else:
        first = min(first, newest_rolled)
    # The hour that pruning cuts through keeps its earlier, complete roll-up.
    first = max(first, hour_start(now - minute_retention()) + HOUR)
    hours = []
    while first <= current:
        hours.append(first)
        first += HOUR
    return hours


def rollup_metrics(*, now: datetime | None = None) -> dict:
    now = now or timezone.now()
    hours = hours_to_roll_up(now)
    rows = sum(rollup_hour(hour) for hour in hours)
    return {"hours": len(hours), "rows": rows}


def prune_metrics(*, now: datetime | None = None) -> dict:
    """Delete minute and hour rows that start before their retention window."""
    now = now or timezone.now()
    minutes, _ = ReplicaMetricsMinute.objects.filter(start__lt=now - minute_retention()).delete()
    hours, _ = ReplicaMetricsHour.objects.filter(start__lt=now - hour_retention()).delete()
    return {"minute_rows": minutes, "hour_rows": hours}
