"""The usage pipeline's SLO fold: each new event judged once at ingest, exactly, however late or repeated."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from costing.models import UsageHour
from slo.budget import MINUTE, floor_minute
from slo.evaluation import evaluate_slos
from slo.models import SloMinute
from slo.services import slo_create
from tenants.ingest import UsageIngestor, store_events
from tests.slo.conftest import NOW, event, insert_events
from tests.tenants.conftest import redis_conn, xadd_events  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db


def create(deployment, **fields):
    defaults = {"name": "chat-ttft", "deployment": deployment, "sli_kind": "latency", "ttft_ms": 200.0,
                "objective": 0.99, "window": "1d"}
    return slo_create(actor=None, **{**defaults, **fields})


def counts(slo) -> dict:
    return {row.minute: (row.good, row.total) for row in SloMinute.objects.filter(slo=slo)}


def test_a_batch_adds_its_verdicts_by_event_time_and_a_repeat_adds_nothing(deployment):
    slo = create(deployment)
    evaluate_slos(now=NOW)  # the back-fill: from now on the pipeline adds each new event
    rows = [event(NOW, ttft_ms=100.0), event(NOW, ttft_ms=300.0), event(NOW - 3 * timedelta(hours=1), ttft_ms=50.0),
            event(NOW, status=429, error_kind="rate_limited")]  # a client error: not counted
    insert_events(rows)
    assert counts(slo) == {floor_minute(NOW): (1, 2), floor_minute(NOW - 3 * timedelta(hours=1)): (1, 1)}
    assert SloMinute.objects.filter(slo=slo, stale=True).count() == 2
    insert_events(rows)  # redelivered: the same request ids are stored, and counted, once
    assert counts(slo) == {floor_minute(NOW): (1, 2), floor_minute(NOW - 3 * timedelta(hours=1)): (1, 1)}
    report = evaluate_slos(now=NOW)
    assert report.touched_keys == 2 and not SloMinute.objects.filter(stale=True).exists()
    slo.refresh_from_db()
    assert (slo.status.good, slo.status.total) == (2, 3)


def test_an_slo_not_yet_backfilled_is_left_to_its_backfill(deployment):
    slo = create(deployment)
    insert_events([event(NOW, ttft_ms=100.0)])
    assert not SloMinute.objects.filter(slo=slo).exists()  # the back-fill reads the stored event
    evaluate_slos(now=NOW)
    assert counts(slo) == {floor_minute(NOW): (1, 1)}


def test_costing_takes_the_verdict_of_the_slo_fold(deployment):
    create(deployment)
    insert_events([event(NOW, ttft_ms=100.0), event(NOW, ttft_ms=300.0)])  # one compliant, one too slow
    [hour] = UsageHour.objects.all()
    assert (hour.requests, hour.prompt_tokens, hour.compliant_prompt_tokens) == (2, 20, 10)
    assert hour.changed


def test_the_stream_consumer_feeds_the_fold(deployment, redis_conn):  # noqa: F811
    slo = create(deployment)
    evaluate_slos(now=NOW)
    late = NOW - 40 * MINUTE
    xadd_events(redis_conn, [{**event(late, ttft_ms=250.0), "time": late.timestamp()}])
    assert UsageIngestor(consumer="test").run(budget_s=10).inserted == 1
    assert counts(slo) == {floor_minute(late): (0, 1)}


def test_store_events_is_the_fold_entry_for_parsed_events(deployment):
    from tenants.ingest import parse_event

    slo = create(deployment)
    evaluate_slos(now=NOW)
    raw = {**event(NOW, ttft_ms=150.0), "time": NOW.timestamp()}
    store_events([parse_event(json.dumps(raw))])
    assert counts(slo) == {floor_minute(NOW): (1, 1)}


def batch_traffic(time) -> list[dict]:
    """Two interactive requests (one too slow) and two lines of an offline batch: one that succeeded
    far slower than any target, one that failed on the server's side."""
    batch = {"batch_id": "batch_3f2a", "priority": -1000, "stream": False}
    return [event(time, ttft_ms=100.0), event(time, ttft_ms=300.0),
            event(time, ttft_ms=9000.0, tpot_ms=500.0, e2e_ms=90000.0, **batch),
            event(time, status=503, error_kind="upstream_error", ttft_ms=None, tpot_ms=None, **batch)]


def test_batch_lines_count_for_availability_and_never_for_latency_or_goodput(deployment):
    latency = create(deployment)
    goodput = create(deployment, name="chat-goodput", sli_kind="goodput")
    availability = create(deployment, name="chat-availability", sli_kind="availability", ttft_ms=None)
    earlier = NOW - timedelta(hours=1)
    insert_events(batch_traffic(earlier))  # stored before the SLOs' back-fill, which judges them in SQL
    evaluate_slos(now=NOW)
    insert_events(batch_traffic(NOW))  # judged by the pipeline's fold, in Python: the same verdicts
    for minute in (floor_minute(earlier), floor_minute(NOW)):
        assert counts(latency)[minute] == (1, 2)
        assert counts(goodput)[minute] == (1, 2)
        # A failed batch line is a failure; a slow one that succeeded is good.
        assert counts(availability)[minute] == (3, 4)


def test_a_batch_line_that_succeeded_is_slo_compliant_for_costing(deployment):
    create(deployment)
    insert_events(batch_traffic(NOW))
    [hour] = UsageHour.objects.all()
    # 10 prompt tokens each: the fast interactive request and the (slow) batch line that succeeded.
    assert (hour.requests, hour.prompt_tokens, hour.compliant_prompt_tokens) == (4, 40, 20)
