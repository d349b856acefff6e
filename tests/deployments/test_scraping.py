"""Scraping replicas' /metrics into minute rows: parsing, deltas, resets, failures, races.

Replicas are small in-test HTTP servers that render the built-in server's own metrics code
(runtime/engine/metrics.py) with values the test sets, so every increase is known exactly.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.db.models import Sum
from django.utils import timezone

from deployments import tasks
from deployments.choices import ReplicaState
from deployments.models import Replica, ReplicaMetricsMinute
from deployments.replicas import scraping
from deployments.replicas.metrics_query import histogram_quantile
from deployments.replicas.scraping import (
    HistogramValues,
    MetricsFetcher,
    MetricsSample,
    ScrapeResult,
    ScrapeTarget,
    counter_delta,
    histogram_delta,
    parse_metrics,
    scrape_cycle,
    store_results,
)
from runtime.engine.metrics import ServerMetrics
from tests.conftest import free_port
from tests.deployments.metrics_helpers import MetricsPage, deployment_with_replicas

VLLM_METRICS = Path(__file__).resolve().parents[2] / "bench/scrape/vllm-0.32-cpu-metrics.txt"


class MetricsStub(MetricsPage):
    """A replica's /metrics endpoint whose gauges, counters and histograms the test drives."""

    def __init__(self) -> None:
        self.restart()
        super().__init__()

    def restart(self) -> None:
        """A new process: every counter and histogram starts again from zero, and the process
        start time moves on (the stub lives in the test's own process, whose real one cannot)."""
        self.started = getattr(self, "started", 1_700_000_000.0) + 60
        self.stats = SimpleNamespace(
            num_running=0, num_waiting=0, kv_cache_usage=0.0, prompt_tokens_total=0,
            generation_tokens_total=0, num_preemptions_total=0, prefix_cache_queries_total=0,
            prefix_cache_hits_total=0)
        self.metrics = ServerMetrics("tiny", lambda: self.stats)

    def render(self) -> bytes:
        return re.sub(rb"^process_start_time_seconds .*$", b"process_start_time_seconds %.1f" % self.started,
                      self.metrics.render(), flags=re.MULTILINE)

    def serve_requests(self, count: int, *, prompt: int, output: int, ttft_s: float) -> None:
        self.stats.prompt_tokens_total += count * prompt
        self.stats.generation_tokens_total += count * output
        for _ in range(count):
            self.metrics.ttft.observe(ttft_s)
            self.metrics.request_success["stop"].inc()



@pytest.fixture
def stubs():
    made: list[MetricsStub] = []

    def make() -> MetricsStub:
        made.append(MetricsStub())
        return made[-1]

    yield make
    for stub in made:
        stub.close()


@pytest.fixture
def replica(db, tiny_llama_dir):
    _, _, replicas = deployment_with_replicas(tiny_llama_dir, replicas=1)
    replica = replicas[0]
    replica.started_at = timezone.now() - timedelta(hours=1)
    replica.save()
    return replica


def minute_totals(replica) -> dict:
    return ReplicaMetricsMinute.objects.filter(replica=replica).aggregate(
        prompt=Sum("prompt_tokens"), generation=Sum("generation_tokens"),
        ttft_count=Sum("ttft_count"), scrapes=Sum("scrapes"))


def scrape(*replicas):
    return scrape_cycle(targets=[ScrapeTarget(r.pk, r.url) for r in replicas],
                        fetcher=MetricsFetcher(total_timeout=2.0, connect_timeout=1.0))


# --- parsing and deltas, no database --------------------------------------------------------


def test_parse_recorded_vllm_metrics():
    sample = parse_metrics(VLLM_METRICS.read_text())
    assert sample.counters == {"prompt_tokens": 19.0, "generation_tokens": 16.0,
                               "preemptions": 0.0, "prefix_cache_queries": 19.0,
                               "prefix_cache_hits": 0.0}
    assert sample.requests_by_reason == {"stop": 0.0, "length": 3.0, "abort": 0.0, "error": 0.0,
                                         "repetition": 0.0}
    assert sample.gauges == {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
    ttft = sample.histograms["ttft"]
    assert (ttft.count, ttft.buckets["0.02"], ttft.buckets["0.04"], ttft.buckets["0.08"]) == \
        (3.0, 0.0, 2.0, 3.0)
    assert ttft.buckets["+Inf"] == 3.0 and len(ttft.buckets) == 23
    assert sample.histograms["itl"].count == 13.0
    assert sample.histograms["e2e"].sum == pytest.approx(0.4, abs=0.2)
    assert sample.process_start == 1.79603646577e09


def test_parse_sums_label_sets_but_keeps_finish_reasons_and_averages_kv_usage():
    text = "\n".join([
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="a"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="a"} 4.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0"} 0.2',
        'vllm:kv_cache_usage_perc{engine="1"} 0.6',
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0"} 10.0',
        'vllm:generation_tokens_total{engine="1"} 5.0',
        # No TYPE line: samples are recognised by name all the same.
        'vllm:request_success_total{engine="0",finished_reason="stop"} 2.0',
        'vllm:request_success_total{engine="1",finished_reason="stop"} 1.0',
        'vllm:request_success_total{engine="1",finished_reason="length"} 7.0',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"} 1.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf"} 2.0',
        'vllm:time_to_first_token_seconds_count{engine="0"} 2.0',
        'vllm:time_to_first_token_seconds_sum{engine="0"} 0.5',
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1"} 3.0',
        'vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf"} 3.0',
        'vllm:time_to_first_token_seconds_count{engine="1"} 3.0',
        'vllm:time_to_first_token_seconds_sum{engine="1"} 0.25',
    ]) + "\n"
    sample = parse_metrics(text)
    assert sample.gauges["waiting"] == 7.0
    assert sample.gauges["kv_cache_usage"] == pytest.approx(0.4)
    assert sample.counters["generation_tokens"] == 15.0
    assert sample.requests_by_reason == {"stop": 3.0, "length": 7.0}
    ttft = sample.histograms["ttft"]
    assert (ttft.buckets, ttft.count, ttft.sum) == ({"0.1": 4.0, "+Inf": 5.0}, 5.0, 0.75)


def test_parse_rejects_pages_without_vllm_metrics():
    with pytest.raises(scraping.MetricsParseError, match="no vllm"):
        parse_metrics("# TYPE up gauge\nup 1\n")


def test_counter_and_histogram_deltas_handle_resets():
    assert counter_delta(10.0, 25.0) == 15.0
    assert counter_delta(25.0, 4.0) == 4.0  # restarted: all of it is new
    assert counter_delta(None, 6.0) == 6.0  # a series that appeared since
    before = HistogramValues({"0.1": 2.0, "1.0": 5.0, "+Inf": 6.0}, sum=3.0, count=6.0)
    after = HistogramValues({"0.1": 3.0, "1.0": 9.0, "+Inf": 10.0}, sum=5.5, count=10.0)
    delta = histogram_delta(before, after)
    assert (delta.buckets, delta.sum, delta.count) == ({"0.1": 1.0, "1.0": 4.0, "+Inf": 4.0},
                                                       2.5, 4.0)
    reset = HistogramValues({"0.1": 1.0, "1.0": 1.0, "+Inf": 2.0}, sum=0.4, count=2.0)
    assert histogram_delta(after, reset).buckets == reset.buckets
    assert scraping.metrics_url("http://h:8001/v1/") == "http://h:8001/metrics"


# --- storing into minute rows ---------------------------------------------------------------


def test_first_scrape_is_baseline_then_deltas_equal_the_increases(replica, stubs):
    stub = stubs()
    stub.serve_requests(4, prompt=10, output=20, ttft_s=0.03)  # before we ever looked
    replica.url = stub.url
    replica.save()
    report = scrape(replica)
    assert (report.store.stored, report.store.baselines) == (1, 1)
    assert minute_totals(replica) == {"prompt": 0, "generation": 0, "ttft_count": 0, "scrapes": 1}

    stub.serve_requests(3, prompt=7, output=11, ttft_s=0.03)
    scrape(replica)
    stub.serve_requests(2, prompt=5, output=1, ttft_s=0.3)
    scrape(replica)
    assert minute_totals(replica) == {"prompt": 3 * 7 + 2 * 5, "generation": 3 * 11 + 2 * 1,
                                      "ttft_count": 5, "scrapes": 3}
    reasons: dict = {}
    for row in ReplicaMetricsMinute.objects.filter(replica=replica):
        reasons = scraping.add_counts(reasons, row.requests_by_reason)
    assert reasons["stop"] == 5 and reasons["length"] == 0
    replica.refresh_from_db()
    assert replica.scrape_state["counters"]["prompt_tokens"] == 4 * 10 + 31


def test_replica_started_this_minute_counts_its_first_scrape(replica, stubs):
    stub = stubs()
    stub.serve_requests(2, prompt=9, output=4, ttft_s=0.05)
    replica.url, replica.started_at = stub.url, timezone.now() - timedelta(seconds=20)
    replica.save()
    scrape(replica)
    assert minute_totals(replica) == {"prompt": 18, "generation": 8, "ttft_count": 2, "scrapes": 1}


def test_counter_reset_counts_the_new_values(replica, stubs):
    stub = stubs()
    replica.url = stub.url
    replica.save()
    stub.serve_requests(50, prompt=10, output=10, ttft_s=0.03)
    scrape(replica)  # baseline at 500 tokens
    stub.restart()
    stub.serve_requests(2, prompt=10, output=3, ttft_s=0.03)
    scrape(replica)
    assert minute_totals(replica) == {"prompt": 20, "generation": 6, "ttft_count": 2, "scrapes": 2}


def test_histogram_bucket_deltas_give_the_percentiles(replica, stubs):
    stub = stubs()
    replica.url = stub.url
    replica.save()
    stub.serve_requests(100, prompt=1, output=1, ttft_s=0.015)  # baseline: not in the deltas
    scrape(replica)
    stub.serve_requests(90, prompt=1, output=1, ttft_s=0.015)  # bucket (0.01, 0.02]
    stub.serve_requests(10, prompt=1, output=1, ttft_s=0.09)  # bucket (0.08, 0.1]
    scrape(replica)
    buckets: dict = {}
    for row in ReplicaMetricsMinute.objects.filter(replica=replica):
        buckets = scraping.add_counts(buckets, row.ttft_buckets)
    assert (buckets["0.01"], buckets["0.02"], buckets["0.08"], buckets["0.1"], buckets["+Inf"]) \
        == (0, 90, 90, 100, 100)
    # p50: rank 50 of 90 in (0.01, 0.02] -> 0.01 + 0.01 * 50/90; p95: rank 95, 5 of 10 in
    # (0.08, 0.1] -> 0.09.
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01 + 0.01 * 50 / 90)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.09)


def sample_with(running: float, waiting: float, kv: float) -> MetricsSample:
    return MetricsSample(gauges={"running": running, "waiting": waiting, "kv_cache_usage": kv},
                         counters={"generation_tokens": 0.0})


def test_gauges_average_and_max_over_the_minute_and_stale_samples_are_dropped(replica):
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=3)
    results = [ScrapeResult(replica.pk, minute + timedelta(seconds=s), sample_with(r, w, kv))
               for s, r, w, kv in ((5, 1, 0, 0.1), (20, 2, 4, 0.2), (35, 6, 2, 0.6))]
    for result in results:
        store_results([result])
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert row.start == minute and row.scrapes == 3
    assert (row.running_avg, row.running_max) == (pytest.approx(3.0), 6.0)
    assert (row.waiting_avg, row.waiting_max) == (pytest.approx(2.0), 4.0)
    assert (row.kv_cache_usage_avg, row.kv_cache_usage_max) == (pytest.approx(0.3), 0.6)
    # An older sample that a slower scraper stores late changes nothing.
    late = ScrapeResult(replica.pk, minute + timedelta(seconds=30), sample_with(99, 99, 0.99))
    assert store_results([late]).stale == 1
    row.refresh_from_db()
    assert (row.scrapes, row.running_max) == (3, 6.0)
    # The next minute gets its own row.
    store_results([ScrapeResult(replica.pk, minute + timedelta(seconds=65), sample_with(8, 0, 0))])
    assert ReplicaMetricsMinute.objects.filter(replica=replica).count() == 2


def test_long_gap_rebaselines_instead_of_spiking_one_minute(replica):
    at = timezone.now() - timedelta(minutes=30)
    first = MetricsSample(counters={"generation_tokens": 100.0})
    later = MetricsSample(counters={"generation_tokens": 5000.0})
    store_results([ScrapeResult(replica.pk, at, first)])
    report = store_results([ScrapeResult(replica.pk, at + timedelta(minutes=20), later)])
    assert report.baselines == 1
    assert minute_totals(replica)["generation"] == 0


# --- failures and concurrency ---------------------------------------------------------------


def test_dead_and_hanging_replicas_do_not_delay_the_rest(db, tiny_llama_dir, stubs):
    _, _, (alive, dead, *hanging) = deployment_with_replicas(tiny_llama_dir, replicas=5)
    stub = stubs()
    alive.url, dead.url = stub.url, f"http://127.0.0.1:{free_port()}"
    listener = socket.socket()  # accepts connections (the kernel does) but never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    for row in hanging:
        row.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    for row in (alive, dead, *hanging):
        row.save()
    try:
        began = time.monotonic()
        report = scrape_cycle(fetcher=MetricsFetcher(total_timeout=1.0, connect_timeout=0.5))
        elapsed = time.monotonic() - began
    finally:
        listener.close()
    # Three one-second deadlines in series would take 3 s; side by side they take one.
    assert elapsed < 2.5
    assert (report.replicas, report.store.stored, report.store.failed) == (5, 1, 4)
    assert ReplicaMetricsMinute.objects.filter(replica=alive).exists()
    dead.refresh_from_db()
    assert dead.last_error.startswith("scrape: ") and "Connect" in dead.last_error
    for row in hanging:
        row.refresh_from_db()
        assert row.last_error.startswith("scrape: ")
        assert "within 1 s" in row.last_error or "Timeout" in row.last_error
        assert row.state == ReplicaState.READY  # health checks own the state
    assert dead.state == ReplicaState.READY
    # Next cycle starts with the failing ones, so their timeouts overlap the healthy fetches.
    assert [target.replica_id for target in scraping.ready_targets()] == [
        dead.pk, *(row.pk for row in hanging), alive.pk]

    dead.url = stub.url
    dead.save()
    scrape(dead)
    dead.refresh_from_db()
    assert dead.last_error == ""


def test_task_scrapes_only_ready_replicas(db, tiny_llama_dir, stubs):
    _, _, (ready, starting) = deployment_with_replicas(tiny_llama_dir, replicas=2)
    stub = stubs()
    Replica.objects.filter(pk=ready.pk).update(url=stub.url)
    Replica.objects.filter(pk=starting.pk).update(url=stub.url, state=ReplicaState.STARTING)
    result = tasks.scrape_replicas()
    assert (result["replicas"], result["stored"]) == (1, 1)
    assert not ReplicaMetricsMinute.objects.filter(replica=starting).exists()


@pytest.mark.django_db(transaction=True)
def test_two_scrapers_at_once_count_every_token_once(tiny_llama_dir, stubs):
    _, _, replicas = deployment_with_replicas(tiny_llama_dir, replicas=3)
    replica_stubs = [stubs() for _ in replicas]
    for row, stub in zip(replicas, replica_stubs, strict=True):
        row.url = stub.url
        row.save()
    scrape(*replicas)  # baselines
    errors: list[BaseException] = []
    reports: list = []

    def scraper():
        try:
            for _ in range(4):
                reports.append(scrape(*replicas))
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    def traffic():
        for _ in range(12):
            for stub in replica_stubs:
                stub.serve_requests(1, prompt=3, output=5, ttft_s=0.03)
            time.sleep(0.01)

    threads = [threading.Thread(target=scraper), threading.Thread(target=scraper),
               threading.Thread(target=traffic)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    scrape(*replicas)  # picks up whatever arrived after the racers' last look
    assert errors == []
    assert sum(not report.skipped for report in reports) >= 4
    for row in replicas:
        assert minute_totals(row)["generation"] == 12 * 5
        assert minute_totals(row)["prompt"] == 12 * 3


# --- Kubernetes replicas: every ready pod is its own target ----------------------------------
# The pods are real HTTP servers with their own /metrics; only the driver's pod listing is a
# stand-in, because no Kubernetes API server can run on this machine.


class PodListing:
    """Stands in for KubernetesDriver.ready_pod_urls: the version's ready pods, as the test sets."""

    def __init__(self, *urls: str) -> None:
        self.urls = list(urls)
        self.asked: list[int] = []
        self.error = ""

    def __call__(self, replica) -> list[str]:
        self.asked.append(replica.pk)
        if self.error:
            raise scraping.DriverError(self.error)
        return list(self.urls)


@pytest.fixture
def kubernetes_rows(db, tiny_llama_dir, stubs):
    """Two ready slots of one Kubernetes version, whose URL is the Service's, and a local replica."""
    _, _, rows = deployment_with_replicas(tiny_llama_dir, replicas=3)
    service = stubs()  # what the Service would answer: a pod picked at random
    service.serve_requests(1000, prompt=100, output=100, ttft_s=0.03)
    local = rows[2]
    for row in rows[:2]:
        row.driver, row.url = "kubernetes", service.url
    local.url = stubs().url
    for row in rows:
        row.started_at = timezone.now() - timedelta(hours=1)
        row.save()
    return rows[0], rows[1], local


def cycle(listing: PodListing):
    return scrape_cycle(targets=scraping.ready_targets(pod_urls=listing),
                        fetcher=MetricsFetcher(total_timeout=2.0, connect_timeout=1.0))


def version_totals(*rows) -> dict:
    totals = [minute_totals(row) for row in rows]
    return {key: sum(t[key] or 0 for t in totals) for key in ("prompt", "generation", "ttft_count")}


def test_each_ready_pod_is_scraped_on_one_row_of_the_version(kubernetes_rows, stubs):
    first, second, local = kubernetes_rows
    pod_a, pod_b = sorted((stubs(), stubs()), key=lambda stub: stub.url)
    pod_a.serve_requests(40, prompt=10, output=10, ttft_s=0.03)  # before the first look
    listing = PodListing(pod_b.url, pod_a.url)

    targets = scraping.ready_targets(pod_urls=listing)
    # One pod per row when the counts match, the same pod on the same row every cycle.
    assert sorted((t.replica_id, t.url, t.pod) for t in targets) == sorted([
        (first.pk, pod_a.url, pod_a.url), (second.pk, pod_b.url, pod_b.url),
        (local.pk, local.url, "")])
    assert listing.asked == [first.pk]  # once per version, never per row

    report = cycle(listing)
    assert (report.replicas, report.targets, report.store.baselines) == (3, 3, 3)
    pod_a.serve_requests(3, prompt=7, output=11, ttft_s=0.03)
    pod_b.serve_requests(2, prompt=5, output=1, ttft_s=0.03)
    cycle(listing)
    # Each pod's own increase, once; the Service's (another pod's) numbers never enter.
    assert minute_totals(first)["prompt"] == 3 * 7
    assert minute_totals(second)["prompt"] == 2 * 5
    assert version_totals(first, second) == {"prompt": 31, "generation": 35, "ttft_count": 5}
    first.refresh_from_db()
    assert first.scrape_state["pods"][pod_a.url]["counters"]["prompt_tokens"] == 40 * 10 + 21
    local.refresh_from_db()
    assert "counters" in local.scrape_state  # a local replica keeps its single flat state

    # A third pod (a scale-up under way): one row counts two pods, summing their load.
    pod_c = stubs()
    listing.urls.append(pod_c.url)
    pod_c.serve_requests(1, prompt=2, output=2, ttft_s=0.03)
    for stub, running, kv in ((pod_a, 2, 0.2), (pod_b, 3, 0.6), (pod_c, 4, 0.4)):
        stub.stats.num_running, stub.stats.kv_cache_usage = running, kv
    targets = scraping.ready_targets(pod_urls=listing)
    doubled = next(row for row in (first, second)
                   if sum(t.replica_id == row.pk for t in targets) == 2)
    cycle(listing)
    latest = ReplicaMetricsMinute.objects.filter(replica=doubled).order_by("-start", "-scrapes").first()
    on_row = [t.pod for t in targets if t.replica_id == doubled.pk]
    stats = {pod_a.url: (2, 0.2), pod_b.url: (3, 0.6), pod_c.url: (4, 0.4)}
    assert latest.running_max == sum(stats[url][0] for url in on_row)  # running adds up
    assert latest.kv_cache_usage_max == pytest.approx(sum(stats[url][1] for url in on_row) / 2)
    assert version_totals(first, second)["prompt"] == 31  # pod c's first look is its baseline


def test_pod_restarts_leaves_and_moves_keep_every_delta_exact(kubernetes_rows, stubs):
    first, second, _ = kubernetes_rows
    pod_a, pod_b = stubs(), stubs()
    listing = PodListing(pod_a.url, pod_b.url)
    cycle(listing)  # baselines
    pod_a.serve_requests(50, prompt=1, output=1, ttft_s=0.03)
    pod_b.serve_requests(5, prompt=1, output=1, ttft_s=0.03)
    cycle(listing)
    pod_b.restart()  # its counters start again from zero; pod a's go on
    pod_a.serve_requests(4, prompt=1, output=1, ttft_s=0.03)
    pod_b.serve_requests(3, prompt=1, output=1, ttft_s=0.03)
    cycle(listing)
    assert version_totals(first, second)["prompt"] == 50 + 5 + 4 + 3

    listing.urls = [pod_a.url]  # pod b is no longer ready: only pod a counts
    pod_a.serve_requests(6, prompt=1, output=1, ttft_s=0.03)
    pod_b.serve_requests(100, prompt=1, output=1, ttft_s=0.03)
    cycle(listing)
    assert version_totals(first, second)["prompt"] == 62 + 6

    # A row stops: the other one takes both pods and continues from their last samples on
    # either row, neither re-counting them nor losing an interval.
    Replica.objects.filter(pk=first.pk).update(state=ReplicaState.STOPPED)
    listing.urls = [pod_a.url, pod_b.url]
    pod_a.serve_requests(7, prompt=1, output=1, ttft_s=0.03)
    pod_b.serve_requests(2, prompt=1, output=1, ttft_s=0.03)
    cycle(listing)
    assert listing.asked[-1] == second.pk
    assert version_totals(first, second)["prompt"] == 68 + 7 + 100 + 2
    # It comes back: pods are dealt again, each continuing from its newest sample.
    Replica.objects.filter(pk=first.pk).update(state=ReplicaState.READY)
    pod_a.serve_requests(1, prompt=1, output=1, ttft_s=0.03)
    pod_b.serve_requests(1, prompt=1, output=1, ttft_s=0.03)
    cycle(listing)
    assert version_totals(first, second)["prompt"] == 177 + 2


def test_a_failing_pod_or_pod_listing_is_reported_on_the_row(kubernetes_rows, stubs):
    counted, spare, _ = kubernetes_rows
    Replica.objects.filter(pk=spare.pk).update(state=ReplicaState.STOPPED)  # both pods on one row
    pod_a = stubs()
    dead = f"http://127.0.0.1:{free_port()}"
    listing = PodListing(pod_a.url, dead)
    cycle(listing)
    pod_a.serve_requests(2, prompt=4, output=4, ttft_s=0.03)
    report = cycle(listing)
    assert (report.store.stored, report.store.failed) == (2, 1)  # pod a and the local replica
    assert minute_totals(counted)["prompt"] == 8  # the live pod still counts
    counted.refresh_from_db()
    assert counted.last_error.startswith(f"scrape: pod {dead}: ")

    listing.error = "HTTP 403 Forbidden: pods is forbidden"
    report = cycle(listing)
    assert report.store.failed == 1
    counted.refresh_from_db()
    assert counted.last_error == "scrape: listing its pods: HTTP 403 Forbidden: pods is forbidden"
    listing.error, listing.urls = "", [pod_a.url]
    cycle(listing)
    counted.refresh_from_db()
    assert counted.last_error == ""
