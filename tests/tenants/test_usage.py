"""The usage API over the ledger (buckets, filters, totals), ledger totals against events in,
and pruning of raw events."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from tenants.ingest import UsageIngestor, store_events
from tenants.models import Tenant, UsageEvent, UsageMinute
from tenants.tasks import prune_usage_events
from tests.tenants.conftest import usage_event, xadd_events

pytestmark = pytest.mark.django_db

HOUR = 1_780_002_000  # a whole hour (epoch seconds)
COUNTERS = ("requests", "errors", "client_errors", "prompt_tokens", "completion_tokens")
BATCH_COUNTERS = ("batch_requests", "batch_errors", "batch_prompt_tokens", "batch_completion_tokens")


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


@pytest.fixture
def ledger(db):
    Tenant.objects.create(name="acme")
    Tenant.objects.create(name="beta")
    store_events([
        usage_event(time=HOUR + 10, tenant="acme", deployment="chat", prompt_tokens=10, completion_tokens=1),
        usage_event(time=HOUR + 1800, tenant="acme", deployment="chat", prompt_tokens=20, completion_tokens=2),
        usage_event(time=HOUR + 3599, tenant="acme", deployment="chat", status=500, error_kind="internal",
                    prompt_tokens=5, completion_tokens=0),
        usage_event(time=HOUR + 3600, tenant="acme", deployment="chat", prompt_tokens=40, completion_tokens=4),
        usage_event(time=HOUR + 3700, tenant="acme", deployment="embed", endpoint="embeddings", prompt_tokens=7,
                    completion_tokens=0, ttft_ms=None, tpot_ms=None),
        usage_event(time=HOUR + 3800, tenant="beta", key_prefix="ffffffff", deployment="chat", status=429,
                    error_kind="rate_limited", prompt_tokens=0, completion_tokens=0),
    ])


def test_hourly_buckets_and_totals(api, ledger):
    body = api("viewer").get(f"/api/v1/usage/?start={iso(HOUR)}&end={iso(HOUR + 7200)}").json()
    assert body["step"] == 3600
    rows = [(r["start"][11:16], r["tenant"], r["deployment"], *(r[c] for c in COUNTERS)) for r in body["results"]]
    hour, next_hour = iso(HOUR)[11:16], iso(HOUR + 3600)[11:16]
    assert rows == [
        (hour, "acme", "chat", 3, 1, 0, 35, 3),
        (next_hour, "acme", "chat", 1, 0, 0, 40, 4),
        (next_hour, "acme", "embed", 1, 0, 0, 7, 0),
        (next_hour, "beta", "chat", 1, 0, 1, 0, 0),
    ]
    assert body["totals"] == {"requests": 6, "errors": 1, "client_errors": 1, "prompt_tokens": 82,
                              "completion_tokens": 7, **dict.fromkeys(BATCH_COUNTERS, 0)}
    first = body["results"][0]
    assert (first["key_prefix"], first["version"]) == ("0a1b2c3d", 1)


def test_filters_steps_and_window(api, ledger):
    client = api("viewer")
    window = f"start={HOUR}&end={HOUR + 7200}"
    acme_chat = client.get(f"/api/v1/usage/?{window}&tenant=acme&deployment=chat&step=30m").json()
    assert [(r["start"][11:16], r["requests"]) for r in acme_chat["results"]] == [
        (iso(HOUR)[11:16], 1), (iso(HOUR + 1800)[11:16], 2), (iso(HOUR + 3600)[11:16], 1)]
    assert acme_chat["totals"]["requests"] == 4
    by_day = client.get(f"/api/v1/usage/?{window}&step=1d").json()
    assert sum(r["requests"] for r in by_day["results"]) == 6
    # A start inside an hour reads from the start of that hour: buckets are whole.
    inside = client.get(f"/api/v1/usage/?start={HOUR + 1200}&end={HOUR + 3600}&tenant=acme").json()
    assert inside["totals"]["requests"] == 3 and inside["start"].startswith(iso(HOUR)[:19])
    assert client.get(f"/api/v1/usage/?{window}&key_prefix=ffffffff").json()["totals"]["requests"] == 1
    assert client.get(f"/api/v1/usage/?{window}&version=1").json()["totals"]["requests"] == 6
    gone = client.get(f"/api/v1/usage/?{window}&deployment=gone").json()  # no usage: empty, not an error
    assert gone["results"] == [] and gone["totals"] == dict.fromkeys(COUNTERS + BATCH_COUNTERS, 0)


def test_batch_lines_are_their_own_series_inside_the_totals(api, ledger):
    store_events([
        usage_event(time=HOUR + 20, tenant="acme", deployment="chat", batch_id="batch_1", priority=-1000,
                    stream=False, prompt_tokens=100, completion_tokens=50),
        usage_event(time=HOUR + 30, tenant="acme", deployment="chat", batch_id="batch_1", priority=-1000,
                    stream=False, status=502, error_kind="upstream_error", prompt_tokens=9, completion_tokens=0),
    ])
    body = api("viewer").get(f"/api/v1/usage/?start={iso(HOUR)}&end={iso(HOUR + 7200)}&tenant=acme"
                             "&deployment=chat").json()
    first = body["results"][0]
    # Batch lines are usage (in requests, errors and tokens) and, apart, their own counters.
    assert [first[c] for c in COUNTERS] == [5, 2, 0, 144, 53]
    assert [first[c] for c in BATCH_COUNTERS] == [2, 1, 109, 50]
    assert [body["totals"][c] for c in BATCH_COUNTERS] == [2, 1, 109, 50]


@pytest.mark.parametrize("query,field,fragment", [
    ("step=30s", "step", "whole number of minutes"),
    ("step=90", "step", "whole number of minutes"),
    ("step=often", "step", "expected a duration"),
    ("step=5", "step", "at least 15 seconds"),
    ("start=yesterday", "start", "not an ISO 8601 time"),
    ("end=soon", "end", "not an ISO 8601 time"),
    (f"start={HOUR + 10}&end={HOUR}", "start", "before end"),
    (f"start={HOUR - 86400 * 30}&end={HOUR}&step=60", "step", "More than 5000 buckets"),
    ("tenant=nobody", "tenant", "No tenant named 'nobody'"),
    ("deployment=Bad_Name", "deployment", "lowercase letters"),
    ("version=v1", "version", "version number"),
])
def test_bad_usage_queries(api, ledger, query, field, fragment):
    response = api("viewer").get(f"/api/v1/usage/?{query}")
    assert response.status_code == 400
    assert fragment in " ".join(response.json()[field])


def test_ledger_totals_equal_events_in(redis_conn):
    rng = random.Random(5)
    events = [usage_event(time=HOUR + rng.uniform(0, 600), tenant=rng.choice(["a", "b", None]),
                          deployment=rng.choice(["chat", "embed"]), version=rng.choice([1, 2, None]),
                          status=rng.choice([200, 200, 200, 429, 503]), prompt_tokens=rng.randint(0, 500),
                          completion_tokens=rng.randint(0, 200), e2e_ms=rng.uniform(1, 9000))
              for _ in range(3000)]
    xadd_events(redis_conn, events)
    report = UsageIngestor(consumer="test", batch_size=500).run(budget_s=60)
    assert (report.read, report.inserted) == (3000, 3000)
    rows = list(UsageMinute.objects.all())
    assert sum(r.requests for r in rows) == 3000
    assert sum(r.prompt_tokens for r in rows) == sum(e["prompt_tokens"] for e in events)
    assert sum(r.completion_tokens for r in rows) == sum(e["completion_tokens"] for e in events)
    assert sum(r.errors for r in rows) == sum(e["status"] == 503 for e in events)
    assert sum(r.client_errors for r in rows) == sum(e["status"] == 429 for e in events)
    assert sum(r.e2e_count for r in rows) == sum(sum(r.e2e_buckets.values()) for r in rows)
    assert sum(r.e2e_count for r in rows) == sum(e["status"] == 200 for e in events)
    assert len(rows) == len({(int(e["time"] // 60), e["tenant"], e["key_prefix"], e["deployment"], e["version"])
                             for e in events})


def test_pruning_drops_old_raw_events_but_keeps_the_ledger(settings):
    settings.INFEROPS_USAGE_EVENT_RETENTION_DAYS = 35
    now = datetime.fromtimestamp(HOUR, UTC)
    old = (now - timedelta(days=36)).timestamp()
    recent = (now - timedelta(days=34)).timestamp()
    store_events([usage_event(time=old), usage_event(time=recent)])
    assert prune_usage_events(now=now) == 1
    assert [e.time.timestamp() for e in UsageEvent.objects.all()] == [pytest.approx(recent)]
    assert UsageMinute.objects.count() == 2
