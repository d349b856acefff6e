"""Hourly roll-ups recomputed from minute rows, and pruning at the retention boundary."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from deployments import tasks
from deployments.models import ReplicaMetricsHour, ReplicaMetricsMinute
from deployments.replicas import retention
from tests.deployments.metrics_helpers import deployment_with_replicas, metrics_row

HOUR = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)


@pytest.fixture
def replicas(db, tiny_llama_dir):
    _, _, rows = deployment_with_replicas(tiny_llama_dir, replicas=2)
    return rows


def minute(replica, offset_minutes, **fields):
    return metrics_row(ReplicaMetricsMinute, replica, HOUR + timedelta(minutes=offset_minutes),
                       **fields)


def test_rollup_combines_the_hours_minutes(replicas):
    first, second = replicas
    minute(first, 0, scrapes=4, running_avg=1.0, running_max=2.0, kv_cache_usage_avg=0.5,
           generation_tokens=100, requests_by_reason={"stop": 3},
           ttft_buckets={"0.1": 1, "+Inf": 3}, ttft_sum=0.9, ttft_count=3)
    minute(first, 30, scrapes=2, running_avg=4.0, running_max=7.0, kv_cache_usage_avg=0.2,
           generation_tokens=50, requests_by_reason={"stop": 1, "length": 2},
           ttft_buckets={"0.1": 2, "+Inf": 2}, ttft_sum=0.1, ttft_count=2)
    minute(first, 60, scrapes=4, generation_tokens=999)  # the next hour
    minute(second, 59, scrapes=3, waiting_avg=2.0, waiting_max=3.0, prompt_tokens=7)

    assert retention.rollup_hour(HOUR + timedelta(minutes=17)) == 2
    row = ReplicaMetricsHour.objects.get(replica=first, start=HOUR)
    assert row.scrapes == 6
    assert row.running_avg == pytest.approx((1.0 * 4 + 4.0 * 2) / 6)  # weighted by scrapes
    assert row.running_max == 7.0
    assert row.kv_cache_usage_avg == pytest.approx((0.5 * 4 + 0.2 * 2) / 6)
    assert row.generation_tokens == 150
    assert row.requests_by_reason == {"stop": 4, "length": 2}
    assert row.ttft_buckets == {"0.1": 3, "+Inf": 5}
    assert (row.ttft_sum, row.ttft_count) == (pytest.approx(1.0), 5)
    other = ReplicaMetricsHour.objects.get(replica=second, start=HOUR)
    assert (other.scrapes, other.waiting_avg, other.waiting_max, other.prompt_tokens) == \
        (3, 2.0, 3.0, 7)


def test_rollup_is_idempotent_and_recomputes(replicas):
    first, _ = replicas
    minute(first, 5, scrapes=4, generation_tokens=100)
    retention.rollup_hour(HOUR)
    retention.rollup_hour(HOUR)
    assert ReplicaMetricsHour.objects.get(replica=first).generation_tokens == 100
    minute(first, 6, scrapes=4, generation_tokens=20)  # a late minute: recomputed, not added
    retention.rollup_hour(HOUR)
    assert ReplicaMetricsHour.objects.count() == 1
    assert ReplicaMetricsHour.objects.get(replica=first).generation_tokens == 120


def test_rollup_task_catches_up_after_an_outage_but_spares_pruned_hours(replicas):
    first, _ = replicas
    now = HOUR + timedelta(hours=5, minutes=10)
    minute(first, 0, scrapes=1, generation_tokens=1)  # 5 hours back, never rolled up
    minute(first, 5 * 60 + 2, scrapes=1, generation_tokens=2)  # this hour
    # Had the task stayed down past retention, the hour pruning cuts through keeps its roll-up.
    much_later = HOUR + timedelta(days=14, minutes=30)
    assert retention.hours_to_roll_up(much_later)[0] == HOUR + timedelta(hours=1)
    result = retention.rollup_metrics(now=now)
    assert result == {"hours": 6, "rows": 2}
    assert sorted(ReplicaMetricsHour.objects.values_list("start", "generation_tokens")) == [
        (HOUR, 1), (HOUR + timedelta(hours=5), 2)]
    # Next run: only the recent hours again.
    assert retention.hours_to_roll_up(now + timedelta(minutes=5)) == [
        HOUR + timedelta(hours=4), HOUR + timedelta(hours=5)]


def test_prune_deletes_rows_before_the_retention_boundary(replicas, settings):
    settings.INFEROPS_METRICS_MINUTE_RETENTION_DAYS = 2
    settings.INFEROPS_METRICS_HOUR_RETENTION_DAYS = 10
    first, _ = replicas
    now = HOUR + timedelta(days=20)
    minute_cut, hour_cut = now - timedelta(days=2), now - timedelta(days=10)
    kept_minute = metrics_row(ReplicaMetricsMinute, first, minute_cut)
    metrics_row(ReplicaMetricsMinute, first, minute_cut - timedelta(minutes=1))
    kept_hour = metrics_row(ReplicaMetricsHour, first, hour_cut)
    metrics_row(ReplicaMetricsHour, first, hour_cut - timedelta(hours=1))
    assert retention.prune_metrics(now=now) == {"minute_rows": 1, "hour_rows": 1}
    assert list(ReplicaMetricsMinute.objects.all()) == [kept_minute]
    assert list(ReplicaMetricsHour.objects.all()) == [kept_hour]
    assert retention.prune_metrics(now=now) == {"minute_rows": 0, "hour_rows": 0}


def test_tasks_run_with_the_current_time(replicas):
    first, _ = replicas
    metrics_row(ReplicaMetricsMinute, first, datetime(2000, 1, 1, tzinfo=UTC))
    assert tasks.prune_metrics()["minute_rows"] == 1
    assert tasks.rollup_metrics()["hours"] >= 2
