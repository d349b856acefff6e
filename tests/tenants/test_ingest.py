"""Usage ingestion from the Redis stream into the ledger: idempotent, complete, and exact."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime

import pytest
from django.db.models import Sum

from deployments.models import Deployment
from tenants import ingest
from tenants.ingest import UsageIngestor, histogram_quantile, latency_bucket, parse_event
from tenants.models import UsageEvent, UsageMinute
from tests.tenants.conftest import usage_event, xadd_events

pytestmark = pytest.mark.django_db

MINUTE = 1_780_000_020.0  # a minute boundary


def ledger_totals() -> dict:
    return UsageMinute.objects.aggregate(
        requests=Sum("requests"), errors=Sum("errors"), client_errors=Sum("client_errors"),
        prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens"))


def test_events_land_in_raw_rows_and_minute_ledger(redis_conn):
    events = [
        usage_event(time=MINUTE + 1, prompt_tokens=10, completion_tokens=20, ttft_ms=50.0, e2e_ms=300.0),
        usage_event(time=MINUTE + 59.9, prompt_tokens=5, completion_tokens=7, ttft_ms=150.0, e2e_ms=500.0),
        usage_event(time=MINUTE + 60, prompt_tokens=1, completion_tokens=0, status=503, error_kind="shed",
                    ttft_ms=None, tpot_ms=None, e2e_ms=2.0),
        usage_event(time=MINUTE + 61, tenant=None, key_prefix=None, version=None, replica=None, status=401,
                    error_kind="auth", prompt_tokens=0, completion_tokens=0, ttft_ms=None, tpot_ms=None, e2e_ms=1.0),
        usage_event(time=MINUTE + 62, tenant=None, key_prefix=None, version=None, replica=None, status=401,
                    error_kind="auth", prompt_tokens=0, completion_tokens=0, ttft_ms=None, tpot_ms=None, e2e_ms=1.0),
        usage_event(time=MINUTE + 63, status=502, error_kind="upstream_connect", completion_tokens=0),
        usage_event(time=MINUTE + 64, prompt_tokens=1, completion_tokens=0, status=503, error_kind="degraded",
                    ttft_ms=None, tpot_ms=None, e2e_ms=1.0),
    ]
    xadd_events(redis_conn, events)
    report = UsageIngestor(consumer="test").run(budget_s=10)
    assert (report.read, report.inserted, report.rejected) == (7, 7, 0)
    assert UsageEvent.objects.count() == 7

    first = UsageMinute.objects.get(minute=datetime.fromtimestamp(MINUTE, UTC))
    assert (first.tenant, first.key_prefix, first.deployment, first.version) == ("acme", "0a1b2c3d", "chat", 1)
    assert (first.requests, first.errors, first.client_errors) == (2, 0, 0)
    assert (first.prompt_tokens, first.completion_tokens) == (15, 27)
    assert (first.ttft_sum_ms, first.ttft_count, first.e2e_count) == (200.0, 2, 2)
    assert first.ttft_buckets == {latency_bucket(50.0): 1, latency_bucket(150.0): 1}

    second = UsageMinute.objects.filter(minute=datetime.fromtimestamp(MINUTE + 60, UTC))
    by_tenant = {row.tenant: row for row in second}
    assert set(by_tenant) == {"acme", None}
    # The shed 503 and the upstream 502 are server errors; neither feeds the latency roll-ups. A 503
    # shed on purpose by the degradation policy is not the server failing: it counts with client errors.
    assert (by_tenant["acme"].requests, by_tenant["acme"].errors, by_tenant["acme"].client_errors) == (3, 2, 1)
    assert by_tenant["acme"].e2e_count == 0 and by_tenant["acme"].e2e_buckets == {}
    # Both 401s (no tenant, key or version) merge into one row despite their NULLs.
    assert (by_tenant[None].requests, by_tenant[None].client_errors, by_tenant[None].version) == (2, 2, None)
    assert redis_conn.xpending(ingest.STREAM_KEY, ingest.GROUP)["pending"] == 0


def test_replays_and_redelivery_are_counted_once(redis_conn):
    events = [usage_event(time=MINUTE + i, prompt_tokens=i, completion_tokens=1) for i in range(50)]
    xadd_events(redis_conn, events)
    UsageIngestor(consumer="first", batch_size=20).run(budget_s=10)
    # The gateway replays its spool (same request ids again), and repeats one inside a batch.
    xadd_events(redis_conn, events[:30] + [events[0]])

    # A consumer reads a batch and dies before acking: its entries stay pending.
    xadd_events(redis_conn, [usage_event(time=MINUTE + 70, prompt_tokens=1000, completion_tokens=1)])
    crashed = redis_conn.xreadgroup(ingest.GROUP, "crashed", {ingest.STREAM_KEY: ">"}, count=100)
    assert len(crashed[0][1]) == 32
    # Its batch is redone by another consumer once idle long enough (0 ms here instead of 60 s).
    report = UsageIngestor(consumer="second", claim_idle_ms=0).run(budget_s=10)
    assert report.claimed == 32 and report.inserted == 1 and report.duplicates == 31
    assert redis_conn.xpending(ingest.STREAM_KEY, ingest.GROUP)["pending"] == 0

    assert UsageEvent.objects.count() == 51
    totals = ledger_totals()
    assert totals["requests"] == 51
    assert totals["prompt_tokens"] == sum(range(50)) + 1000
    # Reading again finds nothing new and changes nothing.
    assert UsageIngestor(consumer="second", claim_idle_ms=0).run(budget_s=10).read == 0
    assert ledger_totals() == totals


def test_a_stale_pending_batch_is_left_alone_until_idle(redis_conn):
    xadd_events(redis_conn, [usage_event()])
    ingest.ensure_group(redis_conn)
    redis_conn.xreadgroup(ingest.GROUP, "busy", {ingest.STREAM_KEY: ">"}, count=10)
    report = UsageIngestor(consumer="other", claim_idle_ms=60_000).run(budget_s=5)
    assert report.read == 0 and not UsageEvent.objects.exists()


def test_invalid_entries_are_moved_aside_and_do_not_block_the_batch(redis_conn):
    good = usage_event()
    xadd_events(redis_conn, [good, usage_event(status="ok"), usage_event(tenant="x" * 64)])
    redis_conn.xadd(ingest.STREAM_KEY, {"e": b"{not json"})
    redis_conn.xadd(ingest.STREAM_KEY, {"other": b"1"})
    report = UsageIngestor(consumer="test").run(budget_s=10)
    assert (report.read, report.inserted, report.rejected) == (5, 1, 4)
    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == [good["request_id"]]
    rejected = redis_conn.xrange(ingest.REJECTED_KEY)
    assert [fields[b"reason"].decode().split(":")[0] for _, fields in rejected] == [
        "status", "tenant", "not JSON", "not JSON"]
    assert redis_conn.xpending(ingest.STREAM_KEY, ingest.GROUP)["pending"] == 0


def test_the_client_request_id_and_who_measured_ttft_are_stored(redis_conn):
    whole = usage_event(stream=False, client_request_id="ord-7", ttft_ms=31.5, tpot_ms=4.25, ttft_source="server")
    streamed = usage_event(client_request_id="x" * 128, ttft_source="gateway")
    bare = usage_event(stream=False, ttft_ms=None, tpot_ms=None, ttft_source=None)  # a vLLM replica: no header
    older = usage_event()  # from a gateway that predates both fields
    xadd_events(redis_conn, [whole, streamed, bare, older])
    assert UsageIngestor(consumer="test").run(budget_s=10).inserted == 4
    stored = {row[0]: row[1:] for row in UsageEvent.objects.values_list(
        "request_id", "client_request_id", "ttft_source", "ttft_ms", "tpot_ms")}
    assert stored == {whole["request_id"]: ("ord-7", "server", 31.5, 4.25),
                      streamed["request_id"]: ("x" * 128, "gateway", 40.0, 8.0),
                      bare["request_id"]: (None, None, None, None),
                      older["request_id"]: (None, None, 40.0, 8.0)}


def test_a_nul_in_a_text_field_is_refused_alone_instead_of_failing_its_batch(redis_conn):
    good = usage_event()
    xadd_events(redis_conn, [good, usage_event(client_request_id="ord\x007"), usage_event(tenant="ac\x00me")])
    report = UsageIngestor(consumer="test").run(budget_s=10)
    assert (report.read, report.inserted, report.rejected) == (3, 1, 2)
    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == [good["request_id"]]
    assert redis_conn.xpending(ingest.STREAM_KEY, ingest.GROUP)["pending"] == 0


def test_ttft_slos_judge_whole_answers_timed_by_the_replica_and_leave_out_unmeasured_ones(redis_conn, deployments):
    from slo.evaluation import evaluate_slos
    from slo.services import slo_create

    at = time.time() - 300
    xadd_events(redis_conn, [
        usage_event(time=at, stream=True, ttft_ms=150.0, ttft_source="gateway"),
        usage_event(time=at, stream=False, ttft_ms=120.0, tpot_ms=5.0, ttft_source="server"),
        usage_event(time=at, stream=False, ttft_ms=450.0, tpot_ms=5.0, ttft_source="server"),
        usage_event(time=at, stream=False, ttft_ms=None, tpot_ms=None, ttft_source=None),  # vLLM, no header
    ])
    assert UsageIngestor(consumer="test").run(budget_s=10).inserted == 4
    slo = slo_create(actor=None, name="chat-ttft", deployment=Deployment.objects.get(name="chat"),
                     sli_kind="latency", ttft_ms=200.0, objective=0.9, window="1d")
    evaluate_slos()
    slo.status.refresh_from_db()
    # Both whole answers timed by the replica count (one too slow); the unmeasured one is left out.
    assert (slo.status.good, slo.status.total) == (2, 3)


def test_whole_numbers_where_floats_are_expected_mix_in_one_batch(redis_conn):
    xadd_events(redis_conn, [usage_event(time=int(MINUTE), e2e_ms=272, ttft_ms=40), usage_event(time=MINUTE + 0.5)])
    assert UsageIngestor(consumer="test").run(budget_s=10).inserted == 2
    assert UsageMinute.objects.get().e2e_sum_ms == 272 + 272.0


def test_histograms_merge_across_batches_and_give_percentiles(redis_conn):
    latencies = [10.0 * (i + 1) for i in range(100)]  # 10 .. 1000 ms
    xadd_events(redis_conn, [usage_event(time=MINUTE, ttft_ms=ms) for ms in latencies])
    UsageIngestor(consumer="test", batch_size=7).run(budget_s=10)
    row = UsageMinute.objects.get()
    assert row.ttft_count == 100 and sum(row.ttft_buckets.values()) == 100
    p50 = histogram_quantile(row.ttft_buckets, 0.50)
    p99 = histogram_quantile(row.ttft_buckets, 0.99)
    # Exact to one bucket (12 % wide): the true values are 500 and 990 ms.
    assert 500 <= p50 <= 500 * 1.13 and 990 <= p99 <= 990 * 1.13


@pytest.mark.parametrize("change,fragment", [
    ({"request_id": None}, "request_id: missing"),
    ({"time": "yesterday"}, "time: expected a finite number"),
    ({"e2e_ms": -1}, "e2e_ms: expected a finite number >= 0"),
    ({"ttft_ms": True}, "ttft_ms: expected a finite number >= 0"),
    ({"tenant": 7}, "tenant: expected a string"),
    ({"prompt_tokens": 2**31}, "prompt_tokens: expected an integer"),
    ({"version": 1.5}, "version: expected an integer"),
    ({"stream": "yes"}, "stream: expected true or false"),
    ({"status": True}, "status: expected an integer"),
    ({"key_prefix": "toolong123"}, "key_prefix: expected a string"),
    ({"client_request_id": 7}, "client_request_id: expected a string of 1-128 characters"),
    ({"client_request_id": "x" * 129}, "client_request_id: expected a string of 1-128 characters"),
    ({"client_request_id": ""}, "client_request_id: expected a string"),
    ({"client_request_id": "ord\u00007"}, "client_request_id: expected a string .*no NUL"),
    ({"ttft_source": ["server"]}, "ttft_source: expected a string of 1-16 characters"),
    ({"ttft_source": True}, "ttft_source: expected a string"),
    ({"ttft_source": "s" * 17}, "ttft_source: expected a string"),
    ({"batch_id": "b" * 65}, "batch_id: expected a string of 1-64 characters"),
    ({"batch_id": ""}, "batch_id: expected a string"),
    ({"batch_id": 41}, "batch_id: expected a string"),
])
def test_parse_event_names_the_bad_field(change, fragment):
    with pytest.raises(ingest.InvalidEvent, match=fragment):
        parse_event(json.dumps(usage_event(**change)))


def test_the_beat_task_runs_one_ingestion_per_host_at_a_time(redis_conn, settings):
    import socket

    from tenants.tasks import ingest_usage_task

    settings.INFEROPS_USAGE_INGEST_BUDGET_S = 5
    xadd_events(redis_conn, [usage_event() for _ in range(3)])
    held = redis_conn.lock(f"{ingest.STREAM_KEY}:lock:{socket.gethostname()}", timeout=30)
    assert held.acquire(blocking=False)
    try:
        assert ingest_usage_task() is None  # another run on this host holds the stream
        assert not UsageEvent.objects.exists()
    finally:
        held.release()
    assert ingest_usage_task()["inserted"] == 3
    assert UsageEvent.objects.count() == 3


def test_idle_consumers_without_pending_entries_are_forgotten(redis_conn):
    xadd_events(redis_conn, [usage_event()])
    UsageIngestor(consumer="gone").run(budget_s=5)
    xadd_events(redis_conn, [usage_event()])
    ingest.ensure_group(redis_conn)
    redis_conn.xreadgroup(ingest.GROUP, "holding", {ingest.STREAM_KEY: ">"}, count=10)
    assert ingest.forget_idle_consumers(redis_conn, idle_ms=60_000) == []
    assert ingest.forget_idle_consumers(redis_conn, idle_ms=0) == ["gone"]
    names = {c["name"] for c in redis_conn.xinfo_consumers(ingest.STREAM_KEY, ingest.GROUP)}
    assert names in ({"holding"}, {b"holding"})


def test_ingested_events_leave_the_redis_stream_and_pending_ones_stay(redis_conn):
    """Chaos suite, soak: acknowledged events stayed in the stream up to the gateways' MAXLEN (a million), so
    Redis's memory grew with every request for days."""
    xadd_events(redis_conn, [usage_event(time=MINUTE + i) for i in range(5)])
    UsageIngestor().run(budget_s=5)
    assert redis_conn.xlen(ingest.STREAM_KEY) == 0
    assert UsageEvent.objects.count() == 5
    # Handed to a worker that died before acknowledging: kept until it is claimed and stored.
    xadd_events(redis_conn, [usage_event(time=MINUTE + 10)])
    redis_conn.xreadgroup(ingest.GROUP, "dead-worker", {ingest.STREAM_KEY: ">"}, count=1)
    UsageIngestor(claim_idle_ms=60_000).run(budget_s=1)
    assert redis_conn.xlen(ingest.STREAM_KEY) == 1


def test_what_this_hosts_consumer_read_while_postgres_was_down_is_redone_at_once(redis_conn):
    """Chaos suite, postgres_down: entries a run read while the database was down stayed pending for
    CLAIM_IDLE_MS (a minute) after it came back, so the ledger lagged a minute behind the outage's end."""
    xadd_events(redis_conn, [usage_event(time=MINUTE + i) for i in range(3)])
    ingest.ensure_group(redis_conn)
    # A pool process of this host read them, then failed to store them (the database was down).
    redis_conn.xreadgroup(ingest.GROUP, f"{socket.gethostname()}-999999", {ingest.STREAM_KEY: ">"}, count=10)
    report = UsageIngestor(claim_idle_ms=60_000).run(budget_s=5)
    assert report.claimed == 3 and UsageEvent.objects.count() == 3
    assert redis_conn.xlen(ingest.STREAM_KEY) == 0


def batch_line(batch_id: str = "batch_3f2a", custom_id: str = "line-1", **fields) -> dict:
    """A line of an offline batch as the batch runner writes it: lowest priority, never streamed."""
    return usage_event(request_id=f"{batch_id}-{custom_id}", batch_id=batch_id, priority=-1000, stream=False,
                       **fields)


def test_batch_lines_count_as_usage_and_in_their_own_counters_but_never_in_latency(redis_conn):
    events = [
        usage_event(time=MINUTE + 1, prompt_tokens=10, completion_tokens=20, ttft_ms=50.0, tpot_ms=5.0, e2e_ms=300.0),
        batch_line(custom_id="a", time=MINUTE + 2, prompt_tokens=100, completion_tokens=200, ttft_ms=9000.0,
                   tpot_ms=90.0, e2e_ms=60000.0),
        batch_line(custom_id="b", time=MINUTE + 3, prompt_tokens=7, completion_tokens=0, status=503,
                   error_kind="upstream_error", ttft_ms=None, tpot_ms=None, e2e_ms=5.0),
        batch_line(custom_id="c", time=MINUTE + 4, prompt_tokens=3, completion_tokens=0, status=400,
                   error_kind="bad_request", ttft_ms=None, tpot_ms=None, e2e_ms=1.0),
    ]
    xadd_events(redis_conn, events)
    assert UsageIngestor(consumer="test").run(budget_s=10).inserted == 4
    assert UsageEvent.objects.get(request_id="batch_3f2a-a").batch_id == "batch_3f2a"
    assert UsageEvent.objects.get(request_id=events[0]["request_id"]).batch_id is None

    row = UsageMinute.objects.get(minute=datetime.fromtimestamp(MINUTE, UTC))
    assert (row.requests, row.errors, row.client_errors) == (4, 1, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (120, 220)
    assert (row.batch_requests, row.batch_errors, row.batch_prompt_tokens, row.batch_completion_tokens) == (
        3, 1, 110, 200)
    # The latency roll-ups hold the interactive request alone, however slow the batch line was.
    assert (row.ttft_sum_ms, row.ttft_count, row.tpot_sum_ms, row.tpot_count) == (50.0, 1, 5.0, 1)
    assert (row.e2e_sum_ms, row.e2e_count) == (300.0, 1)
    assert row.ttft_buckets == {latency_bucket(50.0): 1}
    assert row.e2e_buckets == {latency_bucket(300.0): 1}

    # A re-run line (the runner resumed after a crash) has the same request id: stored and counted once.
    xadd_events(redis_conn, [batch_line(custom_id="a", time=MINUTE + 30, prompt_tokens=100, completion_tokens=200),
                             batch_line(custom_id="d", time=MINUTE + 31, prompt_tokens=1, completion_tokens=2)])
    report = UsageIngestor(consumer="test").run(budget_s=10)
    assert (report.read, report.inserted) == (2, 1)
    row.refresh_from_db()
    assert (row.requests, row.batch_requests, row.batch_prompt_tokens, row.batch_completion_tokens) == (
        5, 4, 111, 202)
    assert row.ttft_count == 1 and row.e2e_count == 1
