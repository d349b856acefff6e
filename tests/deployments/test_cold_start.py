"""Cold starts: a row per replica start with its cause, phases filled from the replica's /metrics,
shown by the API, the deployment page and the control plane's /metrics; and one real replica
process whose four phases come out in order after its first request."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from deployments import services as deployment_services
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, ReplicaStart
from deployments.replicas import reconcile
from deployments.replicas.cold_start import record_cold_start, summary
from deployments.replicas.drivers.base import NoCapacity
from deployments.replicas.drivers.local import LocalProcessDriver
from deployments.replicas.scraping import (
    MetricsFetcher,
    ScrapeTarget,
    fill_cold_starts,
    parse_metrics,
    scrape_cycle,
    start_phases,
)
from registry import services as registry_services
from runtime.engine.metrics import ServerMetrics
from tests.deployments.metrics_helpers import MetricsPage
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db

T0 = 1_800_000_000.0  # Unix seconds: when the test's start was asked for


def page(process: float | None, loaded: float | None = None, first: float | None = None) -> str:
    """A built-in replica's /metrics text with the three moments set (None: not yet)."""
    metrics = ServerMetrics("tiny", lambda: None, loaded_at=lambda: loaded)
    metrics.first_output_at = first
    text = metrics.render().decode()
    if process is None:
        return re.sub(r"^process_start_time_seconds .*\n", "", text, flags=re.MULTILINE)
    return re.sub(r"^process_start_time_seconds .*$", f"process_start_time_seconds {process!r}", text,
                  flags=re.MULTILINE)


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def start_row(replica: Replica, started: float = T0, **fields) -> ReplicaStart:
    return ReplicaStart.objects.create(replica=replica, deployment=replica.deployment, version=replica.version,
                                       started_at=at(started), **fields)


# --- the replica's gauges, parsed and filled in ---------------------------------------------------


def test_the_built_in_server_exports_the_three_moments_zero_until_they_happen():
    metrics = ServerMetrics("tiny", lambda: None, loaded_at=lambda: None)
    before = parse_metrics(metrics.render().decode())
    assert before.process_start is not None and before.weights_loaded is None and before.first_token is None
    timer = metrics.start_request()
    timer.on_tokens(1)
    first = metrics.first_output_at
    metrics.start_request().on_tokens(1)  # a later request's first token changes nothing
    assert metrics.first_output_at == first
    after = parse_metrics(page(T0 + 0.2, T0 + 3.5, T0 + 9.25))
    assert (after.process_start, after.weights_loaded, after.first_token) == (T0 + 0.2, T0 + 3.5, T0 + 9.25)


def test_the_process_start_is_exact_to_a_few_ticks():
    # /proc/stat's btime is whole seconds (rounded down), which would put a process up to a second before
    # its real start; the collector's boot time comes from /proc/uptime instead.
    code = ("from runtime.engine.metrics import ServerMetrics; import sys; "
            "sys.stdout.write(ServerMetrics('tiny', lambda: None).render().decode())")
    spawned = time.time()
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2]).stdout
    started = parse_metrics(text).process_start
    assert spawned - 0.05 <= started <= spawned + 1.0, started - spawned


def test_phases_fill_only_what_is_empty_and_only_from_this_starts_process(tiny_replica):
    start = start_row(tiny_replica, ready_at=at(T0 + 4))
    assert start_phases(start, parse_metrics(page(T0 + 0.3))) == ["process_started_at"]
    assert start_phases(start, parse_metrics(page(T0 + 0.3, T0 + 3))) == ["weights_loaded_at"]
    assert start_phases(start, parse_metrics(page(T0 + 0.3, T0 + 3, T0 + 7))) == ["first_token_at"]
    assert start.seconds() == {"process": pytest.approx(0.3), "weights_loaded": 3.0, "ready": 4.0,
                               "first_token": 7.0}
    assert start_phases(start, parse_metrics(page(T0 + 0.3, T0 + 99, T0 + 99))) == []  # set once
    # An older process (the one this start replaces, read by a scrape in flight) tells nothing.
    other = start_row(tiny_replica)
    assert start_phases(other, parse_metrics(page(T0 - 600, T0 - 590, T0 - 500))) == []
    # Without process_start_time_seconds (no /proc) the weights' moment vouches for the process.
    assert start_phases(other, parse_metrics(page(None, T0 + 2))) == ["weights_loaded_at"]
    failed = start_row(tiny_replica, failed=True)
    assert start_phases(failed, parse_metrics(page(T0 + 0.3, T0 + 3))) == []


def test_vllm_reports_the_process_only(tiny_replica):
    from tests.deployments.test_scraping import VLLM_METRICS

    sample = parse_metrics(VLLM_METRICS.read_text())
    start = start_row(tiny_replica, started=sample.process_start - 1)
    assert fill_cold_starts({tiny_replica.pk: [sample]}) == 1
    start.refresh_from_db()
    assert start.seconds()["process"] == pytest.approx(1.0)
    assert (start.weights_loaded_at, start.first_token_at) == (None, None)


def test_only_the_latest_start_of_each_replica_is_filled(tiny_replica):
    old = start_row(tiny_replica, started=T0 - 100)
    new = start_row(tiny_replica)
    assert fill_cold_starts({tiny_replica.pk: [parse_metrics(page(T0 + 0.5, T0 + 2, T0 + 5))]}) == 1
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.process_started_at is None
    assert new.seconds() == {"process": 0.5, "weights_loaded": 2.0, "ready": None, "first_token": 5.0}
    assert fill_cold_starts({tiny_replica.pk: [parse_metrics(page(T0 + 0.5, T0 + 2, T0 + 5))]}) == 0


@pytest.fixture
def metrics_page():
    pages: list[MetricsPage] = []

    def make(text: str) -> MetricsPage:
        pages.append(MetricsPage(text))
        return pages[-1]

    yield make
    for made in pages:
        made.close()


def test_the_scrape_cycle_and_record_cold_start_fill_the_phases(tiny_replica, metrics_page):
    start = start_row(tiny_replica, ready_at=at(T0 + 4))
    served = metrics_page(page(T0 + 0.25, T0 + 3))
    tiny_replica.url = served.url
    tiny_replica.save()
    scrape_cycle(targets=[ScrapeTarget(tiny_replica.pk, served.url)], fetcher=MetricsFetcher(total_timeout=2.0))
    start.refresh_from_db()
    assert start.seconds() == {"process": 0.25, "weights_loaded": 3.0, "ready": 4.0, "first_token": None}
    served.text = page(T0 + 0.25, T0 + 3, T0 + 4.5)  # the first answer left: no waiting for the next scrape
    recorded = record_cold_start(tiny_replica)
    assert recorded.pk == start.pk and recorded.seconds()["first_token"] == 4.5


def test_record_cold_start_survives_an_unreachable_replica(tiny_replica):
    start = start_row(tiny_replica)
    tiny_replica.url = "http://127.0.0.1:9"  # discard: nothing listens
    assert record_cold_start(tiny_replica, timeout_s=0.5) == start
    tiny_replica.url = ""
    assert record_cold_start(tiny_replica) == start


# --- the reconcile loop: a row per start, its cause, ready and failed ------------------------------


def starts(world) -> list[ReplicaStart]:
    return list(ReplicaStart.objects.filter(deployment=world.deployment).order_by("started_at", "id"))


def scale(world, replicas: int) -> None:
    Deployment.objects.filter(pk=world.deployment.pk).update(replicas=replicas)


def test_a_fresh_deployment_starts_from_zero_and_each_start_gets_ready(world):
    rows = starts(world)
    assert [s.cause for s in rows] == ["from_zero", "from_zero"]
    ready = {r.pk: r.ready_at for r in world.live()}
    assert all(s.ready_at == ready[s.replica_id] and not s.failed for s in rows)
    assert all(s.version_id == world.deployment.version_id for s in rows)

    scale(world, 3)
    world.tick()
    assert starts(world)[-1].cause == "scale"


def test_a_failed_replica_restarts_and_a_start_that_dies_is_failed(world):
    victim = world.live()[0]
    world.driver.crashing.add(victim.version_id)  # what starts now dies at once
    world.driver.dead.add(victim.pk)
    world.tick()  # failed while ready (that start had succeeded), restarted at once, dead again
    world.tick()  # seen dead while starting: that start failed; restarted again
    world.driver.crashing.clear()
    world.tick()  # the last one failed too; this restart lives
    world.tick()
    mine = [s for s in starts(world) if s.replica_id == victim.pk]
    assert [s.cause for s in mine] == ["from_zero", "restart", "restart", "restart"]
    assert [s.failed for s in mine] == [False, True, True, False]
    assert [s.ready_at is not None for s in mine] == [True, False, False, True]


def test_parked_then_woken_is_a_start_from_zero(world):
    scale(world, 0)
    for _ in range(3):
        world.tick()
    assert world.live() == []
    scale(world, 1)
    world.tick()
    assert starts(world)[-1].cause == "from_zero"


def test_waiting_for_capacity_is_no_start_until_it_gets_it(world, monkeypatch):
    scale(world, 3)
    before = len(starts(world))
    real_start = world.driver.start

    def no_gpu(replica, spec):
        raise NoCapacity("no GPU free")

    monkeypatch.setattr(world.driver, "start", no_gpu)
    world.tick()
    waiting = [r for r in world.live() if r.state == ReplicaState.PENDING]
    assert len(waiting) == 1 and waiting[0].last_error.startswith("waiting: ")
    assert len(starts(world)) == before
    monkeypatch.setattr(world.driver, "start", real_start)
    world.tick(5)
    assert len(starts(world)) == before + 1 and starts(world)[-1].cause == "scale"


# --- the API, the page and the control plane's /metrics ----------------------------------------------


def test_api_replicas_carry_their_latest_start_and_cold_starts_list_with_a_summary(world, api):
    client = api("viewer")
    replicas = client.get("/api/v1/deployments/chat/replicas/").json()
    assert len(replicas) == 2
    for row in replicas:
        assert row["cold_start"]["cause"] == "from_zero"
        assert row["cold_start"]["seconds"]["ready"] == pytest.approx(2.0)
        assert set(row["cold_start"]["seconds"]) == {"process", "weights_loaded", "ready", "first_token"}
        assert row["cold_start"]["seconds"]["process"] is None  # not scraped yet

    first = starts(world)[0]
    first.process_started_at = first.started_at + timedelta(seconds=0.5)
    first.weights_loaded_at = first.started_at + timedelta(seconds=1.5)
    first.first_token_at = first.started_at + timedelta(seconds=6)
    first.save()
    scale(world, 3)
    world.tick()
    body = client.get("/api/v1/deployments/chat/cold-starts/").json()
    assert body["count"] == 3 and body["next"] is None
    assert [r["cause"] for r in body["results"]] == ["scale", "from_zero", "from_zero"]  # newest first
    assert body["results"][0]["seconds"]["ready"] is None  # still starting
    assert body["summary"] == {
        "process": {"count": 1, "median": 0.5, "max": 0.5},
        "weights_loaded": {"count": 1, "median": 1.5, "max": 1.5},
        "ready": {"count": 2, "median": 2.0, "max": 2.0},
        "first_token": {"count": 1, "median": 6.0, "max": 6.0}}
    assert set(body["results"][0]) == {"id", "replica", "version", "cause", "started_at", "failed", "seconds"}

    paged = client.get("/api/v1/deployments/chat/cold-starts/?limit=1&offset=1").json()
    assert paged["count"] == 3 and len(paged["results"]) == 1 and paged["next"] and paged["previous"]
    assert paged["results"][0]["id"] == body["results"][1]["id"]
    assert paged["summary"]["ready"]["count"] == 1
    assert client.get("/api/v1/deployments/nope/cold-starts/").status_code == 404
    assert api(None).get("/api/v1/deployments/chat/cold-starts/").status_code == 401


def test_summary_leaves_failed_starts_out(tiny_replica):
    good = start_row(tiny_replica, ready_at=at(T0 + 4))
    bad = start_row(tiny_replica, started=T0 + 100, process_started_at=at(T0 + 101), failed=True)
    assert summary([good, bad])["process"] == {"count": 0, "median": None, "max": None}
    assert summary([good, bad])["ready"] == {"count": 1, "median": 4.0, "max": 4.0}


def test_the_deployment_page_shows_the_last_starts_and_their_median(world, client, make_user):
    client.force_login(make_user("viewer", "page-viewer"))
    html = client.get("/deployments/chat/").content.decode()
    section = html[html.index('id="cold-starts"'):html.index("<h2>Metrics")]
    assert section.count("<tr data-start=") == 2 and section.count("from_zero") >= 2
    assert "Median" in section and "2.00" in section
    assert "<script" not in section


# --- one real replica --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_real_replica_records_all_four_phases_in_order(settings, tmp_path, make_user, tiny_llama_dir):
    settings.INFEROPS_RECONCILE_TIMINGS = {"routing_propagation_s": 0.5, "health_timeout_s": 1}
    settings.INFEROPS_DATA_DIR = tmp_path
    operator = make_user("operator")
    model = registry_services.model_create(name="tiny", task="generate", actor=operator)
    registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=operator)
    deployment = deployment_services.deployment_create(name="chat", model=model, version=1, replicas=1,
                                                       actor=operator)
    try:
        def ready():
            reconcile.reconcile_deployment(deployment.pk)
            return Replica.objects.filter(deployment=deployment, state=ReplicaState.READY).first()

        replica = wait_until(ready, "the replica to become ready", timeout=90, interval=0.3)
        start = ReplicaStart.objects.get(replica=replica)
        assert start.cause == "from_zero" and start.ready_at is not None
        response = httpx.post(f"{replica.url}/v1/completions", timeout=30,
                              json={"model": "chat", "prompt": "Hello", "max_tokens": 4})
        assert response.status_code == 200, response.text
        start = record_cold_start(replica)
        seconds = start.seconds()
        print(f"cold start of the tiny test checkpoint: {seconds}")
        assert None not in seconds.values(), seconds
        assert 0 <= seconds["process"] <= seconds["weights_loaded"] <= seconds["ready"] <= seconds["first_token"]
        assert start.first_token_at <= timezone.now()
    finally:
        driver = LocalProcessDriver()
        for row in Replica.objects.filter(deployment=deployment):
            driver.kill(row)


@pytest.fixture
def tiny_replica(db, tiny_llama_dir) -> Replica:
    from tests.deployments.metrics_helpers import deployment_with_replicas

    _, _, replicas = deployment_with_replicas(tiny_llama_dir, replicas=1)
    return replicas[0]
