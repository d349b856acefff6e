"""Time series of a deployment's replica metrics, for the API and the console charts.

`deployment_series(deployment, series, start, end, step_s)` returns `[[iso_time, value], ...]`,
one point per step beginning at `start`; a step with no data has the value `None` (null in
JSON), so charts show a gap rather than a false zero. Units:

- `*_per_s` series: events per second (sum of the deltas in the step / step seconds);
  `requests_per_s` counts finished requests of every finish reason (stop, length, abort, error);
- latency percentiles (`ttft_p50`, `itl_p95`, `e2e_p99`, ...): milliseconds, estimated from the
  replicas' summed histogram bucket deltas over the step (see `histogram_quantile`);
- `kv_cache_usage`: fraction 0..1, the mean over replicas (per period, then over the step);
- `queue_depth` / `running`: requests, the sum over replicas of their average (per period,
  then averaged over the step).

Minute rows serve ranges that start inside the minute retention; older ranges use hour rows,
for which a step shorter than an hour leaves gaps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from registry.models import ModelVersion
from runtime.models import ReplicaMetricsHour, ReplicaMetricsMinute
from runtime.retention import minute_retention

MAX_POINTS = 5000


def histogram_quantile(q: float, buckets: Mapping[str | float, float]) -> float | None:
    """Estimate the q-quantile from cumulative buckets {le: count}, as Prometheus does.

    Finds the bucket where the rank q * total falls and interpolates linearly inside it (the
    first bucket starts at 0). A rank in the +Inf bucket returns the highest finite bound.
    Returns None without observations or without a +Inf bucket.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = sorted((float(le), float(count)) for le, count in buckets.items())
    if len(bounds) < 2 or not math.isinf(bounds[-1][0]):
        return None
    # Summed or rounded buckets can dip; a cumulative count never does (Prometheus fixes it too).
    cumulative, running = [], 0.0
    for upper, count in bounds:
        running = max(running, count)
        cumulative.append((upper, running))
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next((i for i, (_, count) in enumerate(cumulative[:-1]) if count >= rank),
                 len(cumulative) - 1)
    if index == len(cumulative) - 1:
        return cumulative[-2][0]
    upper, count = cumulative[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = cumulative[index - 1] if index > 0 else (0.0, 0.0)
    if count == below:  # an empty bucket reached only by rank 0
        return lower
    return lower + (upper - lower) * (rank - below) / (count - below)


@dataclass(frozen=True)
class PercentileSeries:
    histogram: str  # ttft, itl or e2e
    quantile: float


@dataclass(frozen=True)
class RateSeries:
    counter: str  # a counter column, or "requests" for the sum over finish reasons


@dataclass(frozen=True)
class GaugeSeries:
    column: str  # a *_avg column
    across_replicas: str  # "sum" or "mean"


SERIES: dict[str, PercentileSeries | RateSeries | GaugeSeries] = {
    "requests_per_s": RateSeries("requests"),
    "output_tokens_per_s": RateSeries("generation_tokens"),
    "prompt_tokens_per_s": RateSeries("prompt_tokens"),
    "preemptions_per_s": RateSeries("preemptions"),
    **{f"{name}_p{round(q * 100)}": PercentileSeries(name, q)
       for name in ("ttft", "itl", "e2e") for q in (0.5, 0.95, 0.99)},
    "kv_cache_usage": GaugeSeries("kv_cache_usage_avg", "mean"),
    "queue_depth": GaugeSeries("waiting_avg", "sum"),
    "running": GaugeSeries("running_avg", "sum"),
}


def rows_model(start: datetime, now: datetime | None = None):
    """Minute rows while `start` lies within their retention, else hour rows."""
    now = now or timezone.now()
    return ReplicaMetricsMinute if start >= now - minute_retention() else ReplicaMetricsHour


def deployment_series(deployment, series: str, start: datetime, end: datetime, step_s: int,
                      *, version=None, now: datetime | None = None) -> list[list]:
    """[[iso_time, value or None], ...] for `series` over the deployment's replicas.

    `version` (a ModelVersion, or a version number of the deployment's model) restricts to
    replicas of that version, for a canary beside its baseline. Raises ValueError naming the
    bad argument.
    """
    spec = SERIES.get(series)
    if spec is None:
        raise ValueError(f"series: unknown {series!r}; choose one of {', '.join(SERIES)}")
    if step_s <= 0:
        raise ValueError("step_s: must be a positive number of seconds")
    if end <= start:
        raise ValueError("end: must be after start")
    steps = math.ceil((end - start).total_seconds() / step_s)
    if steps > MAX_POINTS:
        raise ValueError(f"step_s: {steps} points requested, at most {MAX_POINTS}; "
                         "use a larger step")
    rows = rows_model(start, now).objects.filter(
        deployment=deployment, start__gte=start, start__lt=end)
    if isinstance(version, ModelVersion):
        rows = rows.filter(version=version)
    elif version is not None:
        # A deployment serves one model, so a number names one of its versions.
        rows = rows.filter(version__number=version)
    in_step: dict[int, list] = defaultdict(list)
    for row in rows.only(*_columns(spec)):
        in_step[int((row.start - start).total_seconds() // step_s)].append(row)
    return [
        [(start + timedelta(seconds=index * step_s)).isoformat(),
         _value(spec, in_step[index], step_s) if index in in_step else None]
        for index in range(steps)
    ]


def _columns(spec) -> list[str]:
    if isinstance(spec, PercentileSeries):
        return ["start", f"{spec.histogram}_buckets"]
    if isinstance(spec, RateSeries):
        return ["start", "requests_by_reason" if spec.counter == "requests" else spec.counter]
    return ["start", spec.column]


def _value(spec, rows: list, step_s: int) -> float | None:
    if isinstance(spec, PercentileSeries):
        summed: dict[str, float] = defaultdict(float)
        for row in rows:
            for le, count in getattr(row, f"{spec.histogram}_buckets").items():
                summed[le] += count
        seconds = histogram_quantile(spec.quantile, summed)
        return None if seconds is None else seconds * 1000.0
    if isinstance(spec, RateSeries):
        if spec.counter == "requests":
            total = sum(sum(row.requests_by_reason.values()) for row in rows)
        else:
            total = sum(getattr(row, spec.counter) for row in rows)
        return total / step_s
    # One row per replica and period (a unique pair), so a period's rows are its replicas.
    by_period: dict[datetime, list[float]] = defaultdict(list)
    for row in rows:
        by_period[row.start].append(getattr(row, spec.column))
    combine = sum if spec.across_replicas == "sum" else (lambda values: sum(values) / len(values))
    per_period = [combine(values) for values in by_period.values()]
    return sum(per_period) / len(per_period)
