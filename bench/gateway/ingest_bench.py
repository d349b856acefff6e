"""Usage ingestion benchmark: N gateway usage events through the Redis stream into the ledger.

The producer XADDs N events (default 100,000) shaped like the gateway's (20 tenants x 5 keys,
4 deployments x 2 versions, spread over 30 minutes, 1 in 10 an error) plus a 2 % replay of
already-sent events (what a gateway's spool replay or a redelivery produces). The ingestion under
test is `tenants.ingest.UsageIngestor` -- the code the Celery task `tenants.ingest_usage` runs --
draining the stream in one process until it is empty. Then the checks: every distinct event
stored once (count in = count out), ledger request and token totals equal the events', nothing
left pending.

The peer, in the same run, is the straightforward Django ORM ingestion of the same events, one
at a time: `UsageEvent.objects.get_or_create(request_id=...)`, and when created an UPDATE ...
SET x = x + n (F expressions) on the minute row, or its INSERT -- run on the first
`--peer-events` events only, since it is much slower.

Run from the repository root against a Postgres server where it may create and drop a scratch
database, and a Redis database of its own (it deletes the stream `inferops:usage` there):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/4 \
        .venv/bin/python bench/gateway/ingest_bench.py

Results go to bench/gateway/ingest_results.json (see bench/README.md, "Usage ingestion").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from scratch import bench_model_version, django_on_scratch_database, recreate_scratch_database  # noqa: E402

SCRATCH_DB = "inferops_bench_ingest"
GOAL_EVENTS_PER_S = 5000




def make_events(count: int, seed: int = 1) -> list[dict]:
    """Traffic as a gateway writes it: in time order over the last 30 minutes; 20 tenants with 5
    keys each, every key calling one of 4 deployments (one key per application), 10 % of the
    traffic on a canary version 2, 1 in 10 requests failing (429, shed 503, upstream 502)."""
    rng = random.Random(seed)
    now = time.time()
    tenants = [f"tenant-{i}" for i in range(20)]
    keys = [(tenant, uuid.UUID(int=rng.getrandbits(128)).hex[:8], f"chat-{rng.randint(0, 3)}")
            for tenant in tenants for _ in range(5)]
    times = sorted(now - rng.uniform(0, 1800) for _ in range(count))
    events = []
    for started in times:
        tenant, prefix, deployment = rng.choice(keys)
        failed = rng.random() < 0.1
        status = rng.choice([429, 503, 502]) if failed else 200
        ttft = rng.lognormvariate(4, 0.6)
        completion = 0 if failed else rng.randint(1, 400)
        events.append({
            "request_id": f"gw-{uuid.UUID(int=rng.getrandbits(128)).hex}", "time": started,
            "tenant": tenant, "key_prefix": prefix, "deployment": deployment,
            "version": 2 if rng.random() < 0.1 else 1, "replica": rng.randint(1, 8), "priority": 0,
            "endpoint": "chat", "stream": True, "prompt_tokens": rng.randint(1, 2000), "completion_tokens": completion,
            "ttft_ms": None if failed else ttft, "tpot_ms": None if failed else rng.lognormvariate(3, 0.3),
            "e2e_ms": ttft + completion * 20, "status": status, "finish_reason": None if failed else "stop",
            "error_kind": {429: "rate_limited", 503: "shed", 502: "upstream_error"}.get(status), "retries": 0,
        })
    return events


def seed_slos(deployments: list[str]) -> int:
    """Each deployment the events call, with an availability and a TTFT SLO already back-filled:
    the usage pipeline judges every event against them at ingest (nothing seeded where the
    pipeline predates that: such code judged events later, in the SLO evaluation)."""
    from deployments.models import Deployment
    from slo.models import Slo

    model, version = bench_model_version()
    now = datetime.now(UTC)
    slos = []
    for name in deployments:
        deployment = Deployment.objects.create(name=name, model=model, version=version)
        slos += [Slo(name=f"{name}-availability", deployment=deployment, sli_kind="availability", objective=0.99,
                     watermark=now),
                 Slo(name=f"{name}-ttft", deployment=deployment, sli_kind="latency", ttft_ms=100.0, objective=0.95,
                     watermark=now)]
    Slo.objects.bulk_create(slos)
    return len(slos)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process (here: the Postgres backend serving us)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def produce(client, stream: str, entries: list[dict], chunk: int = 5000) -> float:
    started = time.perf_counter()
    for offset in range(0, len(entries), chunk):
        with client.pipeline(transaction=False) as pipe:
            for event in entries[offset:offset + chunk]:
                pipe.xadd(stream, {"e": json.dumps(event)}, maxlen=1_000_000, approximate=True)
            pipe.execute()
    return time.perf_counter() - started


def naive_orm_ingest(events: list[dict]) -> int:
    """The peer: one event at a time through the ORM, idempotent by request id."""
    from datetime import UTC, datetime

    from django.db import transaction
    from django.db.models import F

    from tenants.ingest import aggregate
    from tenants.models import UsageEvent, UsageMinute

    stored = 0
    for event in events:
        with transaction.atomic():
            fields = {k: v for k, v in event.items() if k not in {"request_id", "time"}}
            _, created = UsageEvent.objects.get_or_create(
                request_id=event["request_id"], defaults={**fields, "time": datetime.fromtimestamp(event["time"], UTC)})
            if not created:
                continue
            stored += 1
            (identity, totals), = aggregate([event]).items()
            minute, tenant, key_prefix, deployment, version = identity
            where = {"minute": datetime.fromtimestamp(minute, UTC), "tenant": tenant, "key_prefix": key_prefix,
                     "deployment": deployment, "version": version}
            counters = {name: getattr(totals, name) for name in ("requests", "errors", "client_errors",
                                                                 "prompt_tokens", "completion_tokens")}
            updated = UsageMinute.objects.filter(**where).update(**{k: F(k) + v for k, v in counters.items()})
            if not updated:
                UsageMinute.objects.create(**where, **counters)
    return stored


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()[0]
    admin_url = django_on_scratch_database(SCRATCH_DB)
    from django.core.management import call_command
    from django.db import connection
    from django.db.models import Sum

    from inferops.redis_client import redis_client
    from tenants import ingest
    from tenants.models import UsageEvent, UsageMinute

    call_command("migrate", verbosity=0)
    client = redis_client()
    if client.exists(ingest.STREAM_KEY):
        recreate_scratch_database(admin_url, SCRATCH_DB, drop_only=True)
        sys.exit(f"{ingest.STREAM_KEY} already exists in this Redis database: another gateway or test uses it; "
                 "point REDIS_URL at a database of the benchmark's own")
    try:
        events = make_events(args.events)
        slo_count = seed_slos(sorted({event["deployment"] for event in events}))
        rng = random.Random(2)
        replayed = rng.sample(events, int(len(events) * args.replay_fraction))
        produce_s = produce(client, ingest.STREAM_KEY, events + replayed)

        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            backend_pid = cursor.fetchone()[0]
        # CPU seconds spent by the consumer (Python) and by its Postgres backend: on a machine
        # shared with other work, wall-clock rates measure the neighbours as much as the code.
        cpu_before = own_cpu_seconds(), process_cpu_seconds(backend_pid)
        started = time.perf_counter()
        report = ingest.UsageIngestor(consumer="bench", batch_size=args.batch_size).run(budget_s=3600)
        ingest_s = time.perf_counter() - started
        python_cpu_s = own_cpu_seconds() - cpu_before[0]
        postgres_cpu_s = process_cpu_seconds(backend_pid) - cpu_before[1]
        totals = UsageMinute.objects.aggregate(requests=Sum("requests"), prompt=Sum("prompt_tokens"),
                                               completion=Sum("completion_tokens"))
        checks = {
            "entries_read_equal_entries_written": report.read == len(events) + len(replayed),
            "events_stored_equal_distinct_events_in": UsageEvent.objects.count() == len(events) == report.inserted,
            "ledger_requests_equal_events_in": totals["requests"] == len(events),
            "ledger_prompt_tokens_equal": totals["prompt"] == sum(e["prompt_tokens"] for e in events),
            "ledger_completion_tokens_equal": totals["completion"] == sum(e["completion_tokens"] for e in events),
            "nothing_pending": client.xpending(ingest.STREAM_KEY, ingest.GROUP)["pending"] == 0,
            "nothing_rejected": report.rejected == 0,
        }
        minute_rows = UsageMinute.objects.count()
        # The pipeline's SLO fold: each availability SLO counted every request that was the
        # server's to serve (not the 429s), exactly once.
        from slo.models import SloMinute

        counted = SloMinute.objects.filter(slo__sli_kind="availability").aggregate(total=Sum("total"))["total"]
        checks["slo_minutes_count_each_served_event_once"] = counted == sum(e["status"] != 429 for e in events)

        # The peer on fresh tables, the first --peer-events events plus their share of replays.
        UsageEvent.objects.all().delete()
        UsageMinute.objects.all().delete()
        peer_events = events[:args.peer_events]
        peer_ids = {event["request_id"] for event in peer_events}
        peer_input = peer_events + [event for event in replayed if event["request_id"] in peer_ids]
        started = time.perf_counter()
        peer_stored = naive_orm_ingest(peer_input)
        peer_s = time.perf_counter() - started
        checks["peer_stored_equal_events_in"] = peer_stored == len(peer_events)
    finally:
        client.delete(ingest.STREAM_KEY, ingest.REJECTED_KEY)
        connection.close()
        recreate_scratch_database(admin_url, SCRATCH_DB, drop_only=True)

    rate = report.read / ingest_s
    peer_rate = len(peer_input) / peer_s
    return {
        "what": "Redis stream -> Postgres usage ledger (raw events + per-minute roll-ups, SLO minutes and "
                "verdicts, costing's hourly usage: the usage pipeline), one consumer process",
        "events": len(events), "replayed_entries": len(replayed), "entries": report.read,
        "batch_size": args.batch_size, "batches": report.batches,
        "produce_seconds": round(produce_s, 2), "ingest_seconds": round(ingest_s, 2),
        "entries_per_s": round(rate), "distinct_events_per_s": round(len(events) / ingest_s),
        "goal_events_per_s": GOAL_EVENTS_PER_S, "meets_goal": rate >= GOAL_EVENTS_PER_S,
        "ledger_minute_rows": minute_rows, "slos_judged_at_ingest": slo_count,
        "consumer_cpu_seconds": round(python_cpu_s, 2), "postgres_backend_cpu_seconds": round(postgres_cpu_s, 2),
        # The consumer and its backend overlap (the reader thread), so with a core each the
        # busier of the two bounds the rate.
        "entries_per_s_cpu_bound": round(report.read / max(python_cpu_s, postgres_cpu_s)),
        "peer": "Django ORM, one event at a time (get_or_create + F() update of the minute row)",
        "peer_events": len(peer_input), "peer_seconds": round(peer_s, 2), "peer_events_per_s": round(peer_rate),
        "speedup_vs_peer": round(rate / peer_rate, 1),
        "checks": checks, "all_checks_pass": all(checks.values()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_before": round(load_before, 2), "load_avg_after": round(os.getloadavg()[0], 2)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000, help="distinct events to send (default 100000)")
    parser.add_argument("--replay-fraction", type=float, default=0.02,
                        help="share of events sent a second time, as a spool replay would (default 0.02)")
    parser.add_argument("--batch-size", type=int, default=2000, help="stream entries per batch (default 2000)")
    parser.add_argument("--peer-events", type=int, default=2000, help="events the ORM peer ingests (default 2000)")
    parser.add_argument("--out", type=Path, default=HERE / "ingest_results.json")
    args = parser.parse_args()
    result = run(args)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
