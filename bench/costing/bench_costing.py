"""Costing at scale: a month of ledger and usage for 50 deployments and 500 tenants.

Seeds a fresh database (default `inferops_bench_costing` on DATABASE_URL's server), then times:
building the month's cost rows from 100 replica runs, the month's hourly usage, the monthly
report (cold and warm), its CSV and PDF, and the month close. As a baseline in the same run it
times the allocation computed straight from the per-minute usage ledger (no hourly roll-up),
which is what a report without costing's roll-ups would have to do.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres REDIS_URL=redis://127.0.0.1:6379/13 \\
        .venv/bin/python bench/costing/bench_costing.py [--tenants 500 --deployments 50 --activity 0.5]

Writes bench/costing/results-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def use_database(name: str) -> None:
    import psycopg

    url = urlparse(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"))
    with psycopg.connect(urlunparse(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    os.environ["DATABASE_URL"] = urlunparse(url._replace(path=f"/{name}"))


def timed(label: str, results: dict, fn):
    start = time.perf_counter()
    value = fn()
    results[label] = round(time.perf_counter() - start, 3)
    print(f"{label}: {results[label]:.3f} s", flush=True)
    return value


def seed(args, month: datetime) -> dict:
    from django.db import connection

    from costing.models import Price
    from deployments.models import Deployment, Replica
    from registry.models import ModelVersion, RegisteredModel
    from slo.models import Slo

    rng = random.Random(7)
    hours = 24 * 30
    end = month + timedelta(hours=hours)
    Price.objects.create(resource="cpu", usd_per_hour="0.048", effective_from=month - timedelta(days=1))
    Price.objects.create(resource="memory", usd_per_hour="0.0065", effective_from=month - timedelta(days=1))
    Price.objects.create(resource="gpu:H100", usd_per_hour="2.49", effective_from=month - timedelta(days=1),
                         effective_to=month + timedelta(days=15))
    Price.objects.create(resource="gpu:H100", usd_per_hour="2.19", effective_from=month + timedelta(days=15))
    deployments = []
    for d in range(args.deployments):
        model = RegisteredModel.objects.create(name=f"model-{d}", task="generate")
        version = ModelVersion.objects.create(
            model=model, number=1, artifact_uri="/nowhere", digest="0" * 64, architecture="LlamaForCausalLM",
            parameter_count=1, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
            vocab_size=320, max_context=256, dtype="float32", weight_bytes=4, kv_cache_bytes_per_token=512,
            has_tokenizer=True, has_chat_template=True)
        resources = {"gpu_type": "H100", "gpu_count": 1, "cpu": "8", "memory": "64Gi"} if d % 2 else {"cpu": "4"}
        deployment = Deployment.objects.create(name=f"dep-{d}", model=model, version=version, resources=resources,
                                               driver="kubernetes")
        Slo.objects.create(name=f"dep-{d}-ttft", deployment=deployment, sli_kind="latency", ttft_ms=250,
                           objective=0.99)
        deployments.append(deployment)
        # Two replicas: one the whole month, one restarted mid-month (two runs).
        Replica.objects.create(deployment=deployment, version=version, driver="kubernetes", node=f"node-{d}",
                               state="stopped", started_at=month, stopped_at=end)
        Replica.objects.create(deployment=deployment, version=version, driver="kubernetes", node=f"node-{d}",
                               state="stopped", started_at=month + timedelta(days=16), stopped_at=end)
    # Usage: each tenant calls two deployments, active in `activity` of the hours; one minute row
    # and one event per active (tenant, deployment, hour).
    minutes, events = [], []
    for t in range(args.tenants):
        for d in rng.sample(range(args.deployments), 2):
            for h in range(hours):
                if rng.random() >= args.activity:
                    continue
                at = month + timedelta(hours=h, minutes=rng.randrange(60))
                prompt, completion = rng.randrange(100, 5000), rng.randrange(50, 2000)
                minutes.append((at, f"tenant-{t}", f"dep-{d}", prompt, completion))
                events.append((f"r{len(events)}", at, f"tenant-{t}", f"dep-{d}", prompt, completion,
                               rng.choice([120.0, 180.0, 240.0, 400.0])))
    with connection.cursor() as cursor:
        cursor.executemany(
            "INSERT INTO tenants_usageminute (minute, tenant, key_prefix, deployment, version, requests, errors, "
            "client_errors, prompt_tokens, completion_tokens, ttft_sum_ms, ttft_count, tpot_sum_ms, tpot_count, "
            "e2e_sum_ms, e2e_count, ttft_buckets, tpot_buckets, e2e_buckets) "
            "VALUES (%s, %s, 'k', %s, 1, 1, 0, 0, %s, %s, 0, 0, 0, 0, 0, 0, '{}', '{}', '{}')", minutes)
        cursor.executemany(
            "INSERT INTO tenants_usageevent (request_id, time, tenant, key_prefix, deployment, version, priority, "
            "endpoint, stream, prompt_tokens, completion_tokens, ttft_ms, tpot_ms, e2e_ms, status, retries, "
            "ingested_at) VALUES (%s, %s, %s, 'k', %s, 1, 0, 'chat', false, %s, %s, %s, 10, 900, 200, 0, now())",
            events)
        cursor.execute("ANALYZE")
    return {"usage_minute_rows": len(minutes), "usage_events": len(events)}


BASELINE_LIMIT_S = 120
BASELINE = """
    WITH cost AS (SELECT deployment, version, hour, sum(usd) AS usd FROM costing_costhour
                  WHERE hour >= %(start)s AND hour < %(end)s GROUP BY 1, 2, 3),
    usage AS (SELECT deployment, version, tenant, date_trunc('hour', minute) AS hour,
                     sum(prompt_tokens + 4 * completion_tokens) AS weight
              FROM tenants_usageminute WHERE minute >= %(start)s AND minute < %(end)s AND tenant IS NOT NULL
              GROUP BY 1, 2, 3, 4),
    busy AS (SELECT deployment, version, hour, sum(weight) AS weight FROM usage GROUP BY 1, 2, 3)
    SELECT u.tenant, sum(c.usd * u.weight / b.weight) FROM usage u JOIN busy b USING (deployment, version, hour)
    JOIN cost c USING (deployment, version, hour) GROUP BY 1
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=500)
    parser.add_argument("--deployments", type=int, default=50)
    parser.add_argument("--activity", type=float, default=0.5, help="share of hours a tenant calls a deployment")
    parser.add_argument("--database", default="inferops_bench_costing")
    args = parser.parse_args()
    use_database(args.database)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", interactive=False, verbosity=0)
    from costing import services
    from costing.ledger import costs_compute, lives_sync
    from costing.models import CostHour, LedgerState, ReplicaLife, UsageHour
    from costing.pdf import report_pdf
    from costing.report import report_csv, report_for

    month = datetime(2026, 3, 1, tzinfo=UTC)
    end = datetime(2026, 4, 1, tzinfo=UTC)
    results: dict = {"date": datetime.now(UTC).date().isoformat(), "cpu": platform.processor() or platform.machine(),
                     "cores": os.cpu_count(), "tenants": args.tenants, "deployments": args.deployments}
    results.update(timed("seed_s", {}, lambda: seed(args, month)))
    print(results, flush=True)
    timed("lives_sync_s", results, lambda: lives_sync(end, None))
    results["replica_runs"] = ReplicaLife.objects.count()
    timed("ledger_month_s", results, lambda: costs_compute(month, end))
    results["cost_hour_rows"] = CostHour.objects.count()

    def usage_hours():
        # The usage pipeline fills these at ingest; the seed wrote its rows straight into the tables
        # (no SLO in the bench: every successful request's tokens are compliant).
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO costing_usagehour (hour, deployment, version, tenant, requests, prompt_tokens, "
                "completion_tokens, compliant_prompt_tokens, compliant_completion_tokens) "
                "SELECT date_trunc('hour', minute), deployment, version, tenant, sum(requests), sum(prompt_tokens), "
                "sum(completion_tokens), sum(prompt_tokens), sum(completion_tokens) FROM tenants_usageminute "
                "WHERE tenant IS NOT NULL AND version IS NOT NULL AND deployment IS NOT NULL GROUP BY 1, 2, 3, 4")

    timed("usage_hours_month_s", results, usage_hours)
    results["usage_hour_rows"] = UsageHour.objects.count()
    with connection.cursor() as cursor:  # the planner's statistics, as autovacuum keeps them on a live system
        cursor.execute("ANALYZE")
    LedgerState.objects.update_or_create(pk=1, defaults={"cost_through": end})
    report = timed("report_cold_s", results, lambda: report_for(month, end, now=end + timedelta(hours=2)))
    timed("report_warm_s", results, lambda: report_for(month, end, now=end + timedelta(hours=2)))
    timed("report_json_s", results, lambda: json.dumps(report))
    timed("csv_s", results, lambda: report_csv(report))
    timed("pdf_s", results, lambda: report_pdf(report))
    results["report_rows"] = len(report["rows"])
    results["total_usd"] = report["total_usd"]

    def baseline():
        from django.db import OperationalError, transaction

        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL statement_timeout = '{BASELINE_LIMIT_S}s'")
                cursor.execute(BASELINE, {"start": month, "end": end})
                return cursor.fetchall()
        except OperationalError:
            results["baseline_timed_out"] = True
            return None

    timed("baseline_allocation_from_minutes_s", results, baseline)
    timed("month_close_s", results, lambda: services.month_close(month=month.date(), now=end + timedelta(hours=2)))
    results["report_vs_baseline"] = round(results["baseline_allocation_from_minutes_s"] / results["report_cold_s"], 2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")  # loadavg while measuring: this machine is shared
    results["load_average_1m"] = round(os.getloadavg()[0], 2)
    out = Path(__file__).with_name(f"results-{results['date']}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
