"""Only the usage pipeline reads or writes the raw usage-event table (issue 37: one usage pipeline).

Every module of the project is scanned for the table's name and for the model's manager; those
allowed are named below with the reason. Every other consumer reads the aggregates the pipeline
folds each new batch into at ingest: tenant usage minutes, SLO minutes, costing's hourly usage.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "inferops", "registry", "alerts", "deployments", "slo", "tenants", "costing", "degradation",
            "project")
READS_EVENTS = re.compile(r"tenants_usageevent|UsageEvent\.objects")

ALLOWED = {
    # The pipeline: stores each batch's new events once and folds them into every aggregate.
    "tenants/ingest.py": "the pipeline",
    # The ledger's retention: deletes events past their retention.
    "tenants/tasks.py": "retention",
    # The back-fill of a new or redefined SLO (issue 37 allows slo's SLI SQL).
    "slo/sli.py": "SLI back-fill",
    # Per-request readers: exact percentiles (percentile_cont) and counts over windows with
    # second boundaries (10 s chart buckets, the watch's last 10 s, a rollout step's start, the
    # overview's last 5 min). Minute aggregates would change what the API and console answer.
    "slo/rollout_gate.py": "per request: rollout analysis and watch",
    "deployments/rollouts/series.py": "per request: 10 s rollout series",
    "deployments/overview.py": "per request: 5-minute TTFT p95 of the overview",
    "deployments/replicas/metrics_query.py": "per request: error-rate steps of any width",
}


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if "migrations" not in path.parts)


def test_only_the_pipeline_reads_the_event_table():
    readers = {path.relative_to(ROOT).as_posix() for path in modules() if READS_EVENTS.search(path.read_text())}
    assert readers - set(ALLOWED) == set(), "read the usage pipeline's aggregates instead"


def test_the_allow_list_names_only_real_readers():
    readers = {path.relative_to(ROOT).as_posix() for path in modules() if READS_EVENTS.search(path.read_text())}
    assert set(ALLOWED) - readers == set(), "an allowed module no longer reads the table: drop it from ALLOWED"
