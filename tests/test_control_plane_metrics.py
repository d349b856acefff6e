"""GET /metrics: the control plane's own figures, read from the database and Redis at scrape time,
equal to what the API says about the same SLO, alert, deployment and stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from degradation.models import DegradationState
from deployments.models import Rollout
from inferops.celery import TASK_FAILURES_KEY
from inferops.celery import app as celery_app
from inferops.redis_client import redis_client
from runtime.gateway.contract import USAGE_STREAM
from slo.budget import MINUTE
from slo.evaluation import evaluate_slos
from slo.models import SloMinute
from tenants.ingest import GROUP as USAGE_GROUP
from tests.processes import stop_process
from tests.services import database_url
from tests.slo.conftest import NOW, event, insert_events, make_deployment
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def clean_redis():
    keys = (USAGE_STREAM, TASK_FAILURES_KEY)
    redis_client().delete(*keys)
    yield
    redis_client().delete(*keys)


def scrape(user) -> dict[str, list]:
    """Family name -> samples, as prometheus_client's own parser reads the page."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.get_or_create(user=user)[0].key}")
    response = client.get("/metrics")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(response.content.decode())}


def values(samples, **labels) -> dict[tuple, float]:
    """Samples whose labels include `labels`, keyed by their other label values."""
    return {tuple(v for k, v in sorted(s.labels.items()) if k not in labels): s.value for s in samples
            if all(s.labels.get(k) == v for k, v in labels.items())}


def test_only_a_token_with_a_role_reads_it(make_user, db):
    anonymous = APIClient().get("/metrics")
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer")
    nobody = APIClient()
    nobody.credentials(HTTP_AUTHORIZATION=f"Bearer {Token.objects.create(user=make_user(None)).key}")
    assert nobody.get("/metrics").status_code == 403
    assert "inferops_slo_burn_rate" in scrape(make_user("viewer"))


def test_slo_budget_burn_and_counters_match_the_status_api(api, make_user):
    make_deployment()
    created = api("operator").post("/api/v1/slos/", {
        "name": "chat-ttft", "deployment": "chat", "sli": {"kind": "latency", "ttft_ms": 500},
        "objective": 0.995, "window": "1d", "budgeting": "occurrences"}, format="json").json()
    idle = api("operator").post("/api/v1/slos/", {
        "name": "chat-idle", "deployment": "chat", "sli": {"kind": "availability"}, "objective": 0.99,
        "window": "1d"}, format="json").json()
    # 30 of 80 requests slow: the budget is overspent, both alerts fire.
    insert_events([event(NOW - MINUTE, ttft_ms=2000.0 if i % 4 == 0 else 100.0) for i in range(40)]
                  + [event(NOW, ttft_ms=2000.0 if i % 2 else 100.0) for i in range(40)])
    evaluate_slos(now=NOW)
    status = api("viewer").get(f"/api/v1/slos/{created['id']}/status/").json()
    metrics = scrape(make_user("viewer"))

    slo = {"slo": "chat-ttft"}
    assert values(metrics["inferops_slo_error_budget_remaining_ratio"], **slo) == {(): status["budget_remaining"]}
    assert status["budget_remaining"] < 0
    assert values(metrics["inferops_slo_burn_rate"], **slo) == {(w,): r for w, r in status["burn_rates"].items()}
    assert len(status["burn_rates"]) == 7
    assert values(metrics["inferops_slo_sli_ratio"], **slo) == {(): status["sli"]} == {(): 50 / 80}
    assert values(metrics["inferops_slo_window_good_events"], **slo) == {(): status["good"]} == {(): 50}
    assert values(metrics["inferops_slo_window_events"], **slo) == {(): status["total"]} == {(): 80}
    assert values(metrics["inferops_slo_state"], **slo) == {(status["status"],): 1}
    # The counters are the running totals of the newest minute: all events ever seen.
    newest = SloMinute.objects.filter(slo_id=created["id"]).order_by("-minute").first()
    good = [s for s in metrics["inferops_slo_sli_good_events"] if s.name.endswith("_total")]
    assert values(good, **slo) == {(): newest.cum_good} == {(): 50}
    total = [s for s in metrics["inferops_slo_sli_events"] if s.name.endswith("_total")]
    assert values(total, **slo) == {(): 80}
    assert values(metrics["inferops_slo_objective_ratio"], slo="chat-idle") == {(): idle["objective"]}

    firing = api("viewer").get("/api/v1/alerts/?status=firing").json()["results"]
    by_severity = {s: sum(1 for a in firing if a["severity"] == s) for s in ("page", "ticket")}
    assert by_severity == {"page": 1, "ticket": 1}
    open_alerts = values(metrics["inferops_alerts_open"], status="firing")
    assert open_alerts == {(sev,): n for sev, n in by_severity.items()}
    assert values(metrics["inferops_alerts_open"], status="acknowledged") == {("page",): 0, ("ticket",): 0}


def test_degradation_level_and_rollout_state_per_deployment(make_user):
    chat, other = make_deployment("chat"), make_deployment("embed", model_name="tiny-embed")
    DegradationState.objects.create(deployment=chat, level=2)
    Rollout.objects.create(deployment=chat, stable_version=chat.version, candidate_version=chat.version,
                           step_started_at=NOW, weight=20, step_index=1,
                           steps=[{"set_weight": 20}, {"pause": None}, {"set_weight": 100}])
    metrics = scrape(make_user("viewer"))
    assert values(metrics["inferops_degradation_level"]) == {("chat",): 2, ("embed",): 0}
    states = values(metrics["inferops_rollout_status"], deployment="chat", strategy="canary")
    assert states[("progressing",)] == 1 and sum(states.values()) == 1
    assert values(metrics["inferops_rollout_candidate_weight_percent"]) == {("chat",): 20}
    assert values(metrics["inferops_rollout_step_index"]) == {("chat",): 1}
    assert values(metrics["inferops_rollout_steps"]) == {("chat",): 3}
    assert other.name not in {s.labels["deployment"] for s in metrics["inferops_rollout_status"]}


def test_usage_stream_depth_and_ingestion_lag(make_user, db):
    client = redis_client()
    client.xgroup_create(USAGE_STREAM, USAGE_GROUP, id="0", mkstream=True)
    old_ms = int(time.time() * 1000) - 30_000
    client.xadd(USAGE_STREAM, {"e": json.dumps({"request_id": "a"})}, id=f"{old_ms}-0")
    client.xadd(USAGE_STREAM, {"e": json.dumps({"request_id": "b"})}, id=f"{old_ms + 10_000}-0")
    viewer = make_user("viewer")
    metrics = scrape(viewer)
    assert values(metrics["inferops_usage_stream_length"]) == {(): 2}
    assert values(metrics["inferops_usage_stream_pending"]) == {(): 0}
    assert values(metrics["inferops_usage_ingest_lag_seconds"])[()] == pytest.approx(30, abs=5)

    # A worker took the first and acknowledged it: the lag is the second's age.
    (_, [(first_id, _)]), = client.xreadgroup(USAGE_GROUP, "w1", {USAGE_STREAM: ">"}, count=1)
    client.xack(USAGE_STREAM, USAGE_GROUP, first_id)
    assert values(scrape(viewer)["inferops_usage_ingest_lag_seconds"])[()] == pytest.approx(20, abs=5)
    # Handed out and never acknowledged (a worker died): still lagging, and pending.
    client.xreadgroup(USAGE_GROUP, "w1", {USAGE_STREAM: ">"}, count=1)
    metrics = scrape(viewer)
    assert values(metrics["inferops_usage_stream_pending"]) == {(): 1}
    assert values(metrics["inferops_usage_ingest_lag_seconds"])[()] == pytest.approx(20, abs=5)
    client.xack(USAGE_STREAM, USAGE_GROUP, *[e[0] for e in client.xrange(USAGE_STREAM)])
    assert values(scrape(viewer)["inferops_usage_ingest_lag_seconds"]) == {(): 0}


@celery_app.task(name="tests.control_plane_metrics.fail")
def fail(kind: str) -> None:
    raise RuntimeError(kind)


def test_celery_task_failures_are_counted_in_redis(make_user, db):
    # apply() runs the task here through Celery's tracer, which sends task_failure as a worker does.
    for _ in range(3):
        fail.apply(args=["boom"])
    assert redis_client().hget(TASK_FAILURES_KEY, fail.name) == b"3"
    samples = [s for s in scrape(make_user("viewer"))["inferops_celery_task_failures"] if s.name.endswith("_total")]
    assert values(samples) == {(fail.name,): 3}


@pytest.mark.timeout(120)
def test_a_real_worker_process_counts_its_failures_where_web_reads_them(make_user, db, tmp_path):
    """The reason for Redis: the failure happens in a worker process, the scrape in web."""
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "inferops.celery", "worker", "--concurrency", "1", "--pool", "solo",
         "--loglevel", "INFO", "--hostname", "metrics-test@%h", "-I", __name__],
        cwd=Path(__file__).resolve().parents[1], env={**os.environ, "DATABASE_URL": database_url()}, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        fail.delay("in a worker")

        def counted() -> bool:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            return redis_client().hget(TASK_FAILURES_KEY, fail.name) is not None

        wait_until(counted, lambda: f"the worker to count the failure\n{(tmp_path / 'worker.log').read_text()}",
                   90, 0.5)
    finally:
        stop_process(worker, 30)
        log.close()
    samples = [s for s in scrape(make_user("viewer"))["inferops_celery_task_failures"] if s.name.endswith("_total")]
    assert values(samples) == {(fail.name,): 1}


def test_cold_start_phases_of_the_latest_ready_start_and_starts_by_cause(make_user):
    from datetime import timedelta

    from deployments.models import Replica, ReplicaStart

    chat, idle = make_deployment("chat"), make_deployment("idle")
    replica = Replica.objects.create(deployment=chat, version=chat.version, node="test")

    def started(ago_s, cause, failed=False, **phases):
        at = NOW - timedelta(seconds=ago_s)
        return ReplicaStart.objects.create(replica=replica, deployment=chat, version=chat.version, cause=cause,
                                           started_at=at, failed=failed,
                                           **{k: at + timedelta(seconds=s) for k, s in phases.items()})

    started(600, "from_zero", process_started_at=1, weights_loaded_at=20, ready_at=22, first_token_at=23)
    started(300, "restart", process_started_at=0.5, weights_loaded_at=9, ready_at=10)  # no first token yet
    started(100, "restart", failed=True, process_started_at=0.5)  # failed: not the latest ready one
    started(10, "scale", process_started_at=0.25)  # still starting
    metrics = scrape(make_user("viewer"))
    assert values(metrics["inferops_replica_cold_start_seconds"]) == {
        ("chat", "process"): 0.5, ("chat", "weights_loaded"): 9.0, ("chat", "ready"): 10.0}
    starts = [s for s in metrics["inferops_replica_starts"] if s.name.endswith("_total")]
    assert values(starts) == {("restart", "chat"): 2, ("from_zero", "chat"): 1, ("scale", "chat"): 1}
    assert idle.name not in {s.labels["deployment"] for s in metrics["inferops_replica_cold_start_seconds"]}
