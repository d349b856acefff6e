"""SLO evaluation benchmark: the cost of one `evaluate-slos` cycle against the length of history.

Each scenario loads a scratch database with SLOs, their per-minute SLI rows (`SloMinute`, with
running totals, as evaluation would have written them) for `history` days, and usage events at
a steady rate for the same days. Then it runs timed cycles the way beat does: before each cycle
one more minute of events arrives (one batch, through ingest, whose usage pipeline adds it into
the SLO minutes, untimed), and `slo.evaluation.evaluate_slos` derives the running totals of the
minutes it touched and evaluates every SLO (window sums, 7 burn rates, 8 alert windows, statuses,
alerts). The peer, in the same run and on the same rows, is the naive evaluation: for each SLO,
one query summing its minute rows over the budget window and each burn window (what a
full-window recompute reads; it grows with the window that history fills).

Scenarios (the machine has 2 cores and other work on it; 1,000 SLOs x 30 days would be 43 M minute
rows, too many to load here):
- `1000x1d`:  1,000 SLOs on 100 deployments, 1 day of history (1.44 M minute rows);
- `100x1d` and `100x30d`: 100 SLOs on 10 deployments with 1 day and 30 days (4.3 M rows):
  the history-growth ratio at the same SLO count.

Run from the repository root against a Postgres server where it may create and drop a scratch
database (the tests' variables work):

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/15 \\
        .venv/bin/python bench/slo/slo_bench.py

Results go to bench/slo/results.json (see bench/README.md, section "SLO evaluation").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from scratch import bench_model_version, django_on_scratch_database, recreate_scratch_database  # noqa: E402

SCRATCH_DB = "inferops_bench_slo"
SCENARIOS = {"1000x1d": (1000, 100, 1), "100x1d": (100, 10, 1), "100x30d": (100, 10, 30)}
EVENTS_PER_MINUTE = 6  # per deployment; history events are what the recompute's index scans skip
NEW_EVENTS_PER_MINUTE = 30  # per deployment, in each timed cycle
# A spread of definitions, as a real fleet would have.
SLI_MIX = [
    {"sli_kind": "availability", "window": "30d"},
    {"sli_kind": "latency", "ttft_ms": 300.0, "window": "30d"},
    {"sli_kind": "latency", "tpot_ms": 50.0, "window": "7d"},
    {"sli_kind": "goodput", "ttft_ms": 500.0, "tpot_ms": 60.0, "window": "28d"},
    {"sli_kind": "availability", "window": "calendar-month", "time_zone": "Europe/Berlin"},
    {"sli_kind": "latency", "e2e_ms": 2000.0, "window": "1d", "budgeting": "timeslices", "timeslice_target": 0.95},
    {"sli_kind": "availability", "window": "calendar-week"},
    {"sli_kind": "latency", "ttft_ms": 1000.0, "window": "30d", "tenant": "acme", "scope": "tenant"},
    {"sli_kind": "goodput", "e2e_ms": 3000.0, "window": "7d"},
    {"sli_kind": "availability", "window": "1d"},
]




def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def reset_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE alerts_delivery, alerts_notification, alerts_alert, slo_slominute, slo_slostatus, "
                       "slo_slo, tenants_usageevent, deployments_deployment, registry_modelversion, "
                       "registry_registeredmodel, registry_auditevent CASCADE")


def load(slo_count: int, deployment_count: int, days: int, start_minute: datetime) -> list:
    """SLOs, their minute rows and the usage events of `days` days before `start_minute`."""
    from django.db import connection

    from deployments.models import Deployment
    from slo.models import Slo, SloStatus

    model, version = bench_model_version()
    deployments = Deployment.objects.bulk_create([
        Deployment(name=f"dep-{i:03d}", model=model, version=version) for i in range(deployment_count)])
    history_start = start_minute - timedelta(days=days)
    slos = []
    for i in range(slo_count):
        spec = {"scope": "deployment", "objective": 0.99, **SLI_MIX[i % len(SLI_MIX)]}
        slos.append(Slo(name=f"slo-{i:04d}", deployment=deployments[i % deployment_count], min_requests=20,
                        backfilled_from=history_start, watermark=None, **spec))
    slos = Slo.objects.bulk_create(slos)
    SloStatus.objects.bulk_create([SloStatus(slo=slo) for slo in slos])
    with connection.cursor() as cursor:
        log(f"  minute rows: {slo_count} SLOs x {days * 1440} minutes")
        # 30 events a minute, one bad every 90 minutes, with running totals as evaluation writes them.
        cursor.execute(
            """
            INSERT INTO slo_slominute (slo_id, minute, good, total, bad_slice, cum_good, cum_total, cum_bad_slices)
            SELECT slo_id, minute, good, 30, good < 29, sum(good) OVER w, sum(30) OVER w,
                   sum((good < 29)::int) OVER w
            FROM (
                SELECT s.id AS slo_id, m AS minute,
                       30 - ((s.id + extract(epoch FROM m)::bigint / 60) %% 90 = 0)::int AS good
                FROM slo_slo s, generate_series(%s::timestamptz, %s::timestamptz, interval '1 minute') AS m
            ) rows
            WINDOW w AS (PARTITION BY slo_id ORDER BY minute)
            """,
            [history_start, start_minute - timedelta(minutes=1)],
        )
        log(f"  usage events: {deployment_count} deployments x {days * 1440} minutes x {EVENTS_PER_MINUTE}")
        cursor.execute(
            """
            INSERT INTO tenants_usageevent (request_id, time, tenant, key_prefix, deployment, version, replica,
                priority, endpoint, stream, prompt_tokens, completion_tokens, ttft_ms, tpot_ms, e2e_ms, status,
                finish_reason, error_kind, retries, ingested_at)
            SELECT 'h-' || d.name || '-' || extract(epoch FROM m)::bigint || '-' || n, m + n * interval '1 second',
                   'acme', '0a1b2c3d', d.name, 1, 1, 0, 'chat', true, 10, 20, 100 + n * 40, 20 + n, 500 + n * 100,
                   CASE WHEN n = 0 AND extract(minute FROM m)::int %% 7 = 0 THEN 503 ELSE 200 END,
                   'stop', CASE WHEN n = 0 AND extract(minute FROM m)::int %% 7 = 0 THEN 'upstream_error' END, 0,
                   m + interval '2 seconds'
            FROM deployments_deployment d,
                 generate_series(%s::timestamptz, %s::timestamptz, interval '1 minute') AS m,
                 generate_series(0, %s - 1) AS n
            """,
            [history_start, start_minute - timedelta(minutes=1), EVENTS_PER_MINUTE],
        )
        cursor.execute("ANALYZE")
    return list(Slo.objects.select_related("deployment"))


def arrive(minute: datetime, ingested_at: datetime, deployment_names: list[str], cycle: int) -> None:
    """One minute of new traffic for every deployment, stored by the ingest code (whose usage
    pipeline adds it into the SLO minutes); one deployment in seven fails 5 requests in 30, so
    alerts open and update as part of the cost. `ingested_at` is the database's now()."""
    from tenants.ingest import store_events

    events = []
    for d in deployment_names:
        failing = int(d[-3:]) % 7 == 3
        for n in range(NEW_EVENTS_PER_MINUTE):
            failed = failing and n < 5
            events.append({
                "request_id": f"c{cycle}-{d}-{n}", "time": minute.timestamp() + n, "tenant": "acme",
                "key_prefix": "0a1b2c3d", "deployment": d, "version": 1, "replica": 1, "priority": 0,
                "endpoint": "chat", "stream": True, "prompt_tokens": 10, "completion_tokens": 20,
                "ttft_ms": 100.0 + n * 10, "tpot_ms": 20.0 + n, "e2e_ms": 400.0 + n * 50,
                "status": 503 if failed else 200, "finish_reason": "stop",
                "error_kind": "upstream_error" if failed else None, "retries": 0})
    store_events(events)


def naive_cycle(slos: list, now: datetime) -> float:
    """The peer: per SLO, sum the minute rows over the budget window and every burn window."""
    from django.db import connection

    from slo.budget import BURN_WINDOWS, MINUTE, window_span

    began = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SET jit = off")  # as evaluate_slos does: same footing
        for slo in slos:
            span = window_span(slo.window, now, slo.time_zone)
            current = span.current_minute
            since = min(span.start, current - (max(BURN_WINDOWS.values()) - 1) * MINUTE)
            sums = ", ".join(
                f"sum(good) FILTER (WHERE minute > %(c)s - interval '{n} minutes'), "
                f"sum(total) FILTER (WHERE minute > %(c)s - interval '{n} minutes')" for n in BURN_WINDOWS.values())
            cursor.execute(
                f"SELECT sum(good) FILTER (WHERE minute >= %(s)s), sum(total) FILTER (WHERE minute >= %(s)s), "
                f"count(*) FILTER (WHERE bad_slice AND minute >= %(s)s), {sums} "
                "FROM slo_slominute WHERE slo_id = %(id)s AND minute >= %(since)s AND minute <= %(c)s",
                {"s": span.start, "c": current, "since": since, "id": slo.pk},
            )
            cursor.fetchone()
        cursor.execute("RESET jit")
    return time.perf_counter() - began


def run_scenario(name: str, cycles: int, start_minute: datetime) -> dict:

    from slo import evaluation
    from slo.evaluation import evaluate_slos
    from slo.models import Slo, SloMinute

    slo_count, deployment_count, days = SCENARIOS[name]
    log(f"scenario {name}: loading")
    reset_tables()
    began = time.perf_counter()
    slos = load(slo_count, deployment_count, days, start_minute)
    load_s = time.perf_counter() - began
    names = sorted({slo.deployment.name for slo in slos})
    # Simulated time: cycles run back to back but each stands for one minute, so the clock that
    # stamps ingestion and the watermarks (the database's now() in production) is the simulated
    # one. With the real clock every cycle would re-read all earlier cycles' events as "within
    # the overlap"; this way each re-reads what production does (the last OVERLAP of ingestion).
    clock = {"now": start_minute}
    evaluation._database_now = lambda: clock["now"]
    # The SLOs were "evaluated" up to the load.
    Slo.objects.update(watermark=start_minute)
    minute_rows = SloMinute.objects.count()
    log(f"  loaded {minute_rows} minute rows in {load_s:.0f} s; {cycles} timed cycles")
    # The machine is shared: say how busy it was, since a busier scenario looks slower.
    load_before_cycles = round(os.getloadavg()[0], 2)
    results = []
    for cycle in range(cycles):
        now = start_minute + cycle * timedelta(minutes=1) + timedelta(seconds=50)
        arrive(now.replace(second=0), now - timedelta(seconds=5), names, cycle)
        clock["now"] = now
        report = evaluate_slos(now=now)
        assert not report.skipped and report.slos == slo_count
        naive_s = naive_cycle(list(Slo.objects.all()), now)
        results.append({"cycle_s": report.seconds, **{k: v for k, v in report.phases.items()},
                        "naive_window_sums_s": naive_s, "minutes_upserted": report.minutes_upserted,
                        "alerts_opened": report.alerts_opened, "alerts_resolved": report.alerts_resolved})
        log(f"  cycle {cycle + 1}: {report.seconds:.2f} s (ingest {report.phases['ingest_s']:.2f}, windows "
            f"{report.phases['windows_s']:.2f}, alerts+status {report.phases['alerts_status_s']:.2f}); "
            f"naive window sums {naive_s:.2f} s")
    steady = results[1:] or results  # the first cycle warms caches
    return {
        "slos": slo_count, "deployments": deployment_count, "history_days": days, "minute_rows": minute_rows,
        "load_s": round(load_s, 1), "load_avg_1m_before_cycles": load_before_cycles,
        "load_avg_1m_after_cycles": round(os.getloadavg()[0], 2),
        "cycle_p50_s": round(statistics.median(r["cycle_s"] for r in steady), 3),
        "windows_p50_s": round(statistics.median(r["windows_s"] for r in steady), 3),
        "naive_window_sums_p50_s": round(statistics.median(r["naive_window_sums_s"] for r in steady), 3),
        "per_cycle": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in results],
    }


def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("INFEROPS_LOG_LEVEL", "WARNING")
    django_on_scratch_database(SCRATCH_DB)
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'tenants_usageevent'")
        indexed = any("(ingested_at)" in row[0] for row in cursor.fetchall())
        if not indexed:
            # The SLO contract asks the usage ledger to index ingested_at; until its migration
            # does, the benchmark adds the index so the one read of new events stays a range scan.
            cursor.execute("CREATE INDEX bench_usageevent_ingested_at ON tenants_usageevent (ingested_at)")
    start_minute = datetime.now(UTC).replace(second=0, microsecond=0)
    scenarios = {name: run_scenario(name, args.cycles, start_minute) for name in args.scenarios}
    result = {
        "benchmark": "slo-evaluation",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
        "ingested_at_index_added_by_bench": not indexed,
        "events_per_minute_per_deployment": {"history": EVENTS_PER_MINUTE, "timed_cycles": NEW_EVENTS_PER_MINUTE},
        "scenarios": scenarios,
    }
    if "100x1d" in scenarios and "100x30d" in scenarios:
        short, long = scenarios["100x1d"], scenarios["100x30d"]
        result["history_growth"] = {
            "cycle_30d_over_1d": round(long["cycle_p50_s"] / short["cycle_p50_s"], 3),
            "naive_30d_over_1d": round(long["naive_window_sums_p50_s"] / short["naive_window_sums_p50_s"], 3),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=4, help="timed cycles per scenario (default 4)")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--output", type=Path, default=HERE / "results.json")
    parser.add_argument("--keep-db", action="store_true", help="leave the scratch database for inspection")
    args = parser.parse_args()
    admin_url = os.environ.get("DATABASE_URL", "")
    try:
        result = run(args)
    finally:
        if not args.keep_db and admin_url:
            from django.db import connections

            connections.close_all()
            recreate_scratch_database(admin_url, SCRATCH_DB, drop_only=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "scenarios"}, indent=2))
    for name, scenario in result["scenarios"].items():
        print(name, {k: v for k, v in scenario.items() if k != "per_cycle"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
