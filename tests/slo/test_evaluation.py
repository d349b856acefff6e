"""evaluate-slos against real Postgres: exact SLIs, budgets, incremental and idempotent cycles."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from inferops.locks import LockId
from slo.budget import MINUTE, floor_minute
from slo.evaluation import evaluate_slos
from slo.models import SloMinute
from slo.services import slo_create, slo_update
from tests.slo.conftest import NOW, event, insert_events, make_deployment

pytestmark = pytest.mark.django_db

AN_HOUR_AGO = timezone.now() - timedelta(hours=1)  # "ingested long ago": outside any overlap


def create(deployment, **fields):
    defaults = {"name": "chat-availability", "deployment": deployment, "sli_kind": "availability",
                "objective": 0.99, "window": "1d"}
    return slo_create(actor=None, **{**defaults, **fields})


def minute_rows(slo) -> list[tuple]:
    return list(SloMinute.objects.filter(slo=slo).order_by("minute").values_list(
        "minute", "good", "total", "bad_slice", "cum_good", "cum_total", "cum_bad_slices"))


def status_of(slo):
    slo.refresh_from_db()
    return slo.status


def test_availability_counts_server_failures_and_leaves_client_errors_out(deployment):
    rows = [event(NOW - 10 * MINUTE, ingested_at=AN_HOUR_AGO) for _ in range(95)]
    rows += [event(NOW - 10 * MINUTE, status=503, error_kind="shed", ingested_at=AN_HOUR_AGO)]
    rows += [event(NOW - 9 * MINUTE, status=200, error_kind="upstream_timeout", ingested_at=AN_HOUR_AGO)]
    client_errors = [(429, "rate_limited"), (401, "auth"), (400, "bad_request"), (499, "client_disconnect"),
                     (503, "degraded")]  # shed on purpose by the degradation policy
    rows += [event(NOW - 9 * MINUTE, status=status, error_kind=kind, ingested_at=AN_HOUR_AGO)
             for status, kind in client_errors]
    rows += [event(NOW - 2 * timedelta(days=1), ingested_at=AN_HOUR_AGO, status=500)]  # outside the 1d window
    insert_events(rows)
    slo = create(deployment)
    evaluate_slos(now=NOW)
    status = status_of(slo)
    # 97 counted (95 good, shed, an upstream timeout), 5 client errors left out.
    assert (status.good, status.total) == (95, 97)
    assert status.sli == pytest.approx(95 / 97)
    assert status.budget_total == pytest.approx(0.97)
    assert status.budget_remaining == pytest.approx(1 - 2 / 0.97)
    assert status.state == "exhausted"
    assert status.burn_rates["30m"] == pytest.approx((2 / 97) / 0.01)
    assert status.burn_rates["5m"] == 0


def test_latency_verdicts_are_exact_for_any_threshold(deployment):
    values = [199.0, 200.0, 200.001, 250.0, None]
    insert_events([event(NOW, ttft_ms=value, ingested_at=AN_HOUR_AGO) for value in values]
                  + [event(NOW, ttft_ms=10.0, status=502, error_kind="upstream_error", ingested_at=AN_HOUR_AGO)])
    latency = create(deployment, name="ttft", sli_kind="latency", ttft_ms=200.0, objective=0.9)
    goodput = create(deployment, name="goodput", sli_kind="goodput", ttft_ms=200.0, tpot_ms=10.0, objective=0.9)
    evaluate_slos(now=NOW)
    # Latency judges successful requests that measured TTFT: 2 of 4 within 200 ms.
    assert (status_of(latency).good, status_of(latency).total) == (2, 4)
    # Goodput: all 6 were the server's to serve; good = succeeded and within every threshold
    # (no TTFT means it does not apply): 199, 200 and the one without TTFT.
    assert (status_of(goodput).good, status_of(goodput).total) == (3, 6)


def test_backfill_from_stored_events_and_backfilled_from(deployment):
    insert_events([event(NOW - 3 * timedelta(hours=1), ingested_at=AN_HOUR_AGO)])
    slo = create(deployment)
    evaluate_slos(now=NOW)
    slo.refresh_from_db()
    assert slo.backfilled_from == floor_minute(NOW - 3 * timedelta(hours=1))
    empty = create(make_deployment("quiet"), name="quiet")
    evaluate_slos(now=NOW)
    empty.refresh_from_db()
    assert empty.backfilled_from == floor_minute(empty.created_at)  # no data: from creation on


def test_cycles_are_idempotent(deployment):
    insert_events([event(NOW - n * MINUTE, status=500 if n % 3 == 0 else 200) for n in range(20)])
    slo = create(deployment)
    evaluate_slos(now=NOW)
    first = minute_rows(slo)
    first_status = status_of(slo).__dict__.copy()
    evaluate_slos(now=NOW)
    assert minute_rows(slo) == first
    second_status = status_of(slo).__dict__.copy()
    for volatile in ("_state", "evaluated_at"):
        first_status.pop(volatile), second_status.pop(volatile)
    assert second_status == first_status


def test_a_cycle_reads_only_new_events_and_late_events_keep_totals_exact(deployment):
    history = [event(NOW - n * MINUTE, ingested_at=AN_HOUR_AGO) for n in range(1, 600)]
    insert_events(history)
    slo = create(deployment)
    assert evaluate_slos(now=NOW).minutes_upserted == 599  # back-fill
    # A new minute and a late event for a minute 30 minutes back arrive.
    insert_events([event(NOW, status=500), event(NOW), event(NOW - 30 * MINUTE, status=500)])
    report = evaluate_slos(now=NOW)
    assert report.touched_keys == 2 and report.minutes_upserted == 2  # not the 599 minutes of history
    rows = minute_rows(slo)
    running_good = running_total = 0
    for _, good, total, _, cum_good, cum_total, _ in rows:
        running_good, running_total = running_good + good, running_total + total
        assert (cum_good, cum_total) == (running_good, running_total)
    status = status_of(slo)
    assert (status.good, status.total) == (600, 602)
    assert status.burn_rates["5m"] == pytest.approx((1 / 6) / 0.01)


def test_timeslices_budget_counts_bad_minutes(deployment):
    # Minute A: 9/10 good (below the 95% slice target: bad); minute B: 19/20 good (meets it).
    insert_events([event(NOW - 5 * MINUTE, status=200 if i < 9 else 500, ingested_at=AN_HOUR_AGO) for i in range(10)]
                  + [event(NOW - 4 * MINUTE, status=200 if i < 19 else 500, ingested_at=AN_HOUR_AGO)
                     for i in range(20)])
    slo = create(deployment, budgeting="timeslices", timeslice_target=0.95, objective=0.99)
    evaluate_slos(now=NOW)
    assert [row[3] for row in minute_rows(slo)] == [True, False]
    status = status_of(slo)
    assert status.budget_total == pytest.approx(14.4)
    assert status.budget_remaining == pytest.approx(1 - 1 / 14.4)
    # The 5m window is the minutes (M-5, M]: minute A lies just outside it.
    assert status.burn_rates["5m"] == 0
    assert status.burn_rates["30m"] == pytest.approx((1 / 30) / 0.01)
    # A definition change (the slice target) re-derives every minute.
    slo_update(slo=slo, actor=None, timeslice_target=0.9)
    evaluate_slos(now=NOW)
    assert [row[3] for row in minute_rows(slo)] == [False, False]


def test_calendar_month_window_in_the_slo_time_zone(deployment):
    # 10 March 12:00 UTC; the Tokyo month began 28 Feb 15:00 UTC.
    insert_events([event(NOW.replace(day=1, hour=1), status=500, ingested_at=AN_HOUR_AGO),  # in March, Tokyo
                   event(NOW.replace(month=2, day=28, hour=14), status=500, ingested_at=AN_HOUR_AGO),  # February
                   event(NOW, ingested_at=AN_HOUR_AGO)])
    tokyo = create(deployment, name="tokyo", window="calendar-month", time_zone="Asia/Tokyo")
    utc = create(deployment, name="utc", window="calendar-month")
    evaluate_slos(now=NOW)
    assert (status_of(tokyo).good, status_of(tokyo).total) == (1, 2)
    assert (status_of(utc).good, status_of(utc).total) == (1, 2)
    slo_update(slo=utc, actor=None, time_zone="Pacific/Honolulu")  # month began 1 March 10:00 UTC
    evaluate_slos(now=NOW)
    assert (status_of(utc).good, status_of(utc).total) == (1, 1)


def test_tenant_and_model_scopes(deployment):
    other = make_deployment("chat-b")
    insert_events([event(NOW, tenant="acme"), event(NOW, tenant="globex", status=500),
                   event(NOW, deployment="chat-b", status=500), event(NOW, deployment="elsewhere", status=500)])
    tenant = create(deployment, name="acme-chat", scope="tenant", tenant="acme")
    model = create(None, name="tiny-all", scope="model", model=other.model)
    evaluate_slos(now=NOW)
    assert (status_of(tenant).good, status_of(tenant).total) == (1, 1)
    assert (status_of(model).good, status_of(model).total) == (1, 3)


def test_a_cycle_is_skipped_while_another_holds_the_lock(deployment):
    from django.db import connections

    create(deployment)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s, 0)", [int(LockId.SLO_EVALUATION)])
        assert evaluate_slos(now=NOW).skipped
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s, 0)", [int(LockId.SLO_EVALUATION)])
    finally:
        other.close()
    assert not evaluate_slos(now=NOW).skipped
    assert connection.is_usable()


def test_ratio_sli_from_scraped_minutes_follows_rows_updated_in_place(deployment):
    from deployments.models import Replica, ReplicaMetricsMinute

    replicas = [Replica.objects.create(deployment=deployment, version=deployment.version, node="n") for _ in range(2)]

    def scraped(replica, start, **counters):
        defaults = {"deployment": deployment, "version": deployment.version, **counters}
        ReplicaMetricsMinute.objects.update_or_create(replica=replica, start=start, defaults=defaults)

    scraped(replicas[0], NOW - 2 * MINUTE, prefix_cache_queries=100, prefix_cache_hits=60,
            requests_by_reason={"stop": 3, "length": 1}, e2e_count=3)
    scraped(replicas[1], NOW - 2 * MINUTE, prefix_cache_queries=50, prefix_cache_hits=45, requests_by_reason={})
    scraped(replicas[0], NOW, prefix_cache_queries=10, prefix_cache_hits=9)
    hits = create(deployment, name="cache-hits", sli_kind="ratio", ratio_good="prefix_cache_hits",
                  ratio_total="prefix_cache_queries", objective=0.5)
    # "requests" is the sum of requests_by_reason (finished requests of any reason).
    timed = create(deployment, name="timed", sli_kind="ratio", ratio_good="e2e_count", ratio_total="requests",
                   objective=0.5)
    evaluate_slos(now=NOW)
    assert (status_of(hits).good, status_of(hits).total) == (114, 160)
    assert (status_of(timed).good, status_of(timed).total) == (3, 4)
    # The scraper keeps adding to the current minute's row; the next cycle re-reads it.
    scraped(replicas[0], NOW, prefix_cache_queries=20, prefix_cache_hits=10)
    evaluate_slos(now=NOW + timedelta(seconds=20))
    assert (status_of(hits).good, status_of(hits).total) == (115, 170)
    assert [row[1:3] for row in minute_rows(hits)] == [(105, 150), (10, 20)]


def test_pruning_keeps_an_anchor_so_old_windows_stay_exact(deployment):
    from slo.evaluation import prune_minutes

    insert_events([event(NOW - n * timedelta(hours=1), status=500 if n % 4 == 0 else 200, ingested_at=AN_HOUR_AGO)
                   for n in range(48)])
    slo = create(deployment, window="1d")
    evaluate_slos(now=NOW)
    before = status_of(slo).__dict__.copy()
    # Keep 30 hours: rows older go, except the newest of them (the anchor before the cut).
    assert prune_minutes(now=NOW, keep=timedelta(hours=30)) == 48 - 31 - 1
    assert SloMinute.objects.filter(slo=slo).count() == 32
    evaluate_slos(now=NOW)
    after = status_of(slo).__dict__.copy()
    for volatile in ("_state", "evaluated_at"):
        before.pop(volatile), after.pop(volatile)
    assert after == before and after["total"] == 24


def test_a_redefinition_during_a_cycle_still_gets_its_backfill(deployment):
    from slo.evaluation import _save_watermarks
    from slo.models import Slo

    insert_events([event(NOW - 10 * MINUTE, ingested_at=AN_HOUR_AGO)])
    slo = create(deployment)
    evaluate_slos(now=NOW)
    in_flight = list(Slo.objects.all())  # what a running cycle holds
    slo_update(slo=slo, actor=None, sli_kind="latency", ttft_ms=50.0)  # commits mid-cycle
    _save_watermarks(in_flight)  # the cycle ends
    assert Slo.objects.get(pk=slo.pk).watermark is None
    evaluate_slos(now=NOW)
    assert (status_of(slo).good, status_of(slo).total) == (0, 1)  # re-derived: 100 ms > 50 ms
