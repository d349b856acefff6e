"""Percentiles from histogram buckets, and a deployment's series from hand-built rows."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from deployments.models import Replica, ReplicaMetricsHour, ReplicaMetricsMinute
from deployments.replicas.metrics_query import deployment_series, histogram_quantile
from tests.deployments.metrics_helpers import deployment_with_replicas, metrics_row

# --- histogram_quantile, worked by hand -----------------------------------------------------

BUCKETS = {"0.1": 10, "0.2": 30, "0.5": 40, "+Inf": 40}


@pytest.mark.parametrize(("q", "expected"), [
    (0.25, 0.1),  # rank 10 is the whole first bucket: its upper bound
    (0.1, 0.04),  # rank 4 of 10 in (0, 0.1]
    (0.5, 0.15),  # rank 20: 10 of 20 into (0.1, 0.2]
    (0.95, 0.44),  # rank 38: 8 of 10 into (0.2, 0.5]
    (1.0, 0.5),
])
def test_quantile_interpolates_linearly_inside_the_bucket(q, expected):
    assert histogram_quantile(q, BUCKETS) == pytest.approx(expected)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    assert histogram_quantile(0.9, {"0.1": 5, "0.2": 8, "+Inf": 10}) == 0.2
    assert histogram_quantile(0.99, {0.5: 0, 1.0: 0, math.inf: 3}) == 1.0


def test_quantile_without_observations_or_inf_bucket_is_none():
    assert histogram_quantile(0.5, {"0.1": 0, "+Inf": 0}) is None
    assert histogram_quantile(0.5, {}) is None
    assert histogram_quantile(0.5, {"0.1": 3, "0.2": 4}) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, BUCKETS)


def test_quantile_repairs_a_dip_in_cumulative_counts():
    # 2.0 -> 4 is below 1.0 -> 5; treated as 5, so rank 4 lies in the first bucket: 0.8.
    assert histogram_quantile(0.4, {"1.0": 5, "2.0": 4, "+Inf": 10}) == pytest.approx(0.8)


# --- deployment_series from hand-built rows -------------------------------------------------

T0 = datetime(2026, 11, 2, 12, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)


@pytest.fixture
def rows(db, tiny_llama_dir):
    """Two replicas (versions 1 and 2) with minute rows at T0+0, +1, +2 and +5 minutes."""
    deployment, versions, (first, second) = deployment_with_replicas(
        tiny_llama_dir, replicas=2, versions=2)
    for replica, scale in ((first, 1), (second, 3)):
        for minute in (0, 1, 2, 5):
            metrics_row(
                ReplicaMetricsMinute, replica, T0 + timedelta(minutes=minute), scrapes=4,
                requests_by_reason={"stop": 6 * scale, "length": 6 * scale},
                generation_tokens=120 * scale,
                ttft_buckets={"0.1": 10 * scale, "0.2": 20 * scale, "+Inf": 20 * scale},
                kv_cache_usage_avg=0.1 * scale, waiting_avg=1.0 * scale)
    return deployment, versions


def values(points):
    return [value for _, value in points]


def series(deployment, name, *, minutes=8, step_s=120, **extra):
    return deployment_series(deployment, name, T0, T0 + timedelta(minutes=minutes), step_s,
                             now=NOW, **extra)


def test_series_times_and_gaps(rows):
    deployment, _ = rows
    points = series(deployment, "requests_per_s")
    assert [time for time, _ in points] == [
        "2026-11-02T12:00:00+00:00", "2026-11-02T12:02:00+00:00", "2026-11-02T12:04:00+00:00",
        "2026-11-02T12:06:00+00:00"]
    assert values(points)[3] is None  # no rows in [12:06, 12:08): a gap, not a zero


def test_rates_sum_the_deltas_in_the_step_over_its_length(rows):
    deployment, _ = rows
    # Step 0 holds minutes 0 and 1 of both replicas: (12 + 36) requests each minute.
    assert values(series(deployment, "requests_per_s")) == pytest.approx(
        [2 * 48 / 120, 48 / 120, 48 / 120, None])
    assert values(series(deployment, "output_tokens_per_s")) == pytest.approx(
        [2 * 480 / 120, 480 / 120, 480 / 120, None])


def test_percentiles_come_from_the_summed_buckets_in_ms(rows):
    deployment, _ = rows
    # Summed over replicas and minutes, half the TTFTs are <= 0.1 s and all <= 0.2 s:
    # p95 lies 90% into (0.1, 0.2], p50 at the top of the first bucket.
    assert values(series(deployment, "ttft_p95"))[:3] == pytest.approx([190.0] * 3)
    assert values(series(deployment, "ttft_p50"))[:3] == pytest.approx([100.0] * 3)
    assert values(series(deployment, "itl_p95")) == [None] * 4  # no ITL observations


def test_gauges_mean_or_sum_over_replicas(rows):
    deployment, _ = rows
    assert values(series(deployment, "kv_cache_usage"))[:3] == pytest.approx([0.2] * 3)
    assert values(series(deployment, "queue_depth"))[:3] == pytest.approx([4.0] * 3)


def test_version_split(rows):
    deployment, (first, second) = rows
    assert values(series(deployment, "queue_depth", version=second))[:3] == pytest.approx(
        [3.0] * 3)
    # By number, as the API passes it: version 1 is the first replica's (scale 1).
    assert values(series(deployment, "output_tokens_per_s", minutes=2, version=first.number)) \
        == pytest.approx([240 / 120])
    assert values(series(deployment, "output_tokens_per_s", minutes=2, version=7)) == [None]


def test_ranges_past_minute_retention_read_hour_rows(rows):
    deployment, (first, _) = rows
    old = T0 - timedelta(days=30)
    replica = Replica.objects.get(version=first)
    metrics_row(ReplicaMetricsHour, replica, old, scrapes=240, generation_tokens=7200)
    points = deployment_series(deployment, "output_tokens_per_s", old, old + timedelta(hours=2),
                               3600, now=NOW)
    assert values(points) == pytest.approx([2.0, None])


def test_bad_arguments_name_the_field(rows):
    deployment, _ = rows
    with pytest.raises(ValueError, match="series: unknown 'tokens'"):
        series(deployment, "tokens")
    with pytest.raises(ValueError, match="step_s"):
        series(deployment, "queue_depth", step_s=0)
    with pytest.raises(ValueError, match="step_s: 480000 points"):
        series(deployment, "queue_depth", minutes=8000, step_s=1)
    with pytest.raises(ValueError, match="end"):
        deployment_series(deployment, "queue_depth", T0, T0, 60, now=NOW)
