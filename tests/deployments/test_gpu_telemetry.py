"""GPU telemetry into replica minute rows, from each of its three sources, and into the hour roll-up.

No GPU, NVML driver or dcgm-exporter runs on this machine, so the GPU series come from two
hand-made recordings: tests/fixtures/nvml/h100-x2.json, NVML's answers for two H100s (replayed by
runtime.gpu_telemetry.ReplayNvml, which the built-in engine's own /metrics and the worker's NVML
read both go through), and tests/fixtures/dcgm/gpu-node-1-pod-mapping.txt, a page written by hand
in dcgm-exporter 3.3's format with Kubernetes pod mapping on (see its README). Everything else is
real: the replicas' pages are served over HTTP, parsed, stored in Postgres and rolled up.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from deployments.choices import DriverName
from deployments.models import ReplicaMetricsHour, ReplicaMetricsMinute
from deployments.replicas import retention, scraping
from deployments.replicas.drivers.kubernetes import KubernetesDriver, KubernetesSettings
from deployments.replicas.drivers.local import node_name, replica_marker
from deployments.replicas.gpu_metrics import NO_POD_MAPPING, GpuSource, GpuStats, parse_gpu_text
from deployments.replicas.scraping import MetricsFetcher, ScrapeTarget, parse_metrics, scrape_cycle
from inferops.models import installation_id
from runtime import gpu_telemetry
from runtime.engine.metrics import ServerMetrics
from runtime.gpu_telemetry import GpuCollector, ReplayNvml
from tests.deployments.metrics_helpers import MetricsPage, deployment_with_replicas, metrics_row
from tests.deployments.test_kubernetes_driver import FakeKubernetesApi, pod

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NVML_H100_X2 = FIXTURES / "nvml" / "h100-x2.json"
DCGM_PAGE = FIXTURES / "dcgm" / "gpu-node-1-pod-mapping.txt"
VLLM_PAGE = Path(__file__).resolve().parents[2] / "bench/scrape/vllm-0.32-cpu-metrics.txt"
OUR_POD, OUR_NAMESPACE = "inferops-chat-v3-6c9f7d8b5-x2kqp", "inferops"

# The recording's two H100s, as NVML reports them: utilisation 97 and 34 %, frame buffer used
# 73427 and 18211 MiB, free 8131 and 63347 MiB, 652.311 and 312.456 W, 67 and 41 C, 1980 and 1755 MHz.
BOTH_H100S = GpuStats(devices=2, util_percent=65.5, memory_used_mib=91638.0, memory_total_mib=163116.0,
                      power_watts=pytest.approx(964.767), temp_max_c=67.0, sm_clock_mhz=1867.5)
SECOND_H100 = GpuStats(devices=1, util_percent=34.0, memory_used_mib=18211.0, memory_total_mib=81558.0,
                       power_watts=312.456, temp_max_c=41.0, sm_clock_mhz=1755.0)
# The dcgm page's GPUs 0 and 1, those dcgm-exporter labels with our pod.
OUR_POD_GPUS = GpuStats(devices=2, util_percent=89.0, memory_used_mib=148428.0, memory_total_mib=161910.0,
                        power_watts=pytest.approx(1052.437), temp_max_c=64.0, sm_clock_mhz=1972.5)




@pytest.fixture
def pages():
    made: list[MetricsPage] = []

    def make(text: str = "") -> MetricsPage:
        made.append(MetricsPage(text))
        return made[-1]

    yield make
    for page in made:
        page.close()


def builtin_page(recording: dict | Path = NVML_H100_X2, devices: list[str] | None = None) -> str:
    """A built-in replica's /metrics, rendered by its own metrics code, its GPUs read from a replayed NVML."""
    collector = GpuCollector(devices=devices, nvml=ReplayNvml(recording), hostname="gpu-node-1")
    return ServerMetrics("tiny", lambda: None, gpu_collector=collector).render().decode()


def with_utilisation(percent: tuple[int, int]) -> dict:
    recording = json.loads(NVML_H100_X2.read_text())
    for device, value in zip(recording["devices"], percent, strict=True):
        device["nvmlDeviceGetUtilizationRates"]["gpu"] = value
    return recording


def fetch(*targets: ScrapeTarget) -> list:
    return MetricsFetcher(total_timeout=2.0, connect_timeout=1.0).fetch_all(targets)


def stats_of(row) -> dict:
    return {name: getattr(row, name) for name in (
        "gpu_devices", "gpu_scrapes", "gpu_minutes", "gpu_util_avg", "gpu_util_max", "gpu_memory_used_avg",
        "gpu_memory_total", "gpu_power_avg", "gpu_temp_max", "gpu_sm_clock_avg")}


@pytest.fixture
def replica(db, tiny_llama_dir):
    _, _, (row,) = deployment_with_replicas(tiny_llama_dir, replicas=1)
    row.started_at = timezone.now() - timedelta(hours=1)
    row.save()
    return row


# --- one parser ------------------------------------------------------------------------------


def test_the_builtin_replicas_own_page_carries_its_gpus():
    sample = parse_metrics(builtin_page())
    assert sample.gpu == BOTH_H100S
    assert parse_metrics(VLLM_PAGE.read_text()).gpu is None  # vLLM exports none


def test_dcgm_exporter_series_are_kept_for_the_pods_gpus_only():
    text = DCGM_PAGE.read_text()
    assert parse_gpu_text(text, pod=OUR_POD, namespace=OUR_NAMESPACE) == (OUR_POD_GPUS, "")
    # A pod of that name in another namespace holds none of them; a pod holding none gets None.
    assert parse_gpu_text(text, pod=OUR_POD, namespace="other") == (None, "")
    # Without pod mapping (no pod labels at all) every GPU of the node counts, with a note.
    unmapped = re.sub(r',container="[^"]*",namespace="[^"]*",pod="[^"]*"', "", text)
    stats, note = parse_gpu_text(unmapped, pod=OUR_POD, namespace=OUR_NAMESPACE)
    assert note == NO_POD_MAPPING
    assert stats == GpuStats(devices=4, util_percent=53.25, memory_used_mib=168428.0, memory_total_mib=323820.0,
                             power_watts=pytest.approx(1372.737), temp_max_c=64.0, sm_clock_mhz=1511.25)


# --- storing ---------------------------------------------------------------------------------


def test_gpu_series_average_over_the_minutes_scrapes_and_a_scrape_without_them_changes_nothing(replica, pages):
    page = pages(builtin_page(with_utilisation((90, 40))))
    target = ScrapeTarget(replica.pk, page.url)
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=5)
    results = fetch(target)
    page.text = builtin_page(with_utilisation((70, 20)))
    results += fetch(target)
    page.text = VLLM_PAGE.read_text()  # the same replica, its GPU series gone for one scrape
    results += fetch(target)
    for seconds, result in zip((5, 20, 35), results, strict=True):
        result.scraped_at = minute + timedelta(seconds=seconds)
        scraping.store_results([result])
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert row.scrapes == 3
    assert stats_of(row) == {
        "gpu_devices": 2, "gpu_scrapes": 2, "gpu_minutes": 1,
        "gpu_util_avg": 55.0, "gpu_util_max": 65.0,  # per scrape the mean over devices: 65, then 45
        "gpu_memory_used_avg": 91638.0, "gpu_memory_total": 163116.0,
        "gpu_power_avg": pytest.approx(964.767), "gpu_temp_max": 67.0, "gpu_sm_clock_avg": 1867.5}


def test_a_minute_without_gpu_series_has_no_gpu_telemetry(replica, pages):
    page = pages(VLLM_PAGE.read_text())
    scrape_cycle(targets=[ScrapeTarget(replica.pk, page.url)], fetcher=MetricsFetcher(total_timeout=2.0))
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert row.scrapes == 1
    assert stats_of(row) == {name: 0 for name in stats_of(row)}


def test_the_hour_weighs_gpu_averages_by_the_scrapes_that_carried_them(replica):
    hour = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
    metrics_row(ReplicaMetricsMinute, replica, hour, scrapes=4, gpu_devices=2, gpu_scrapes=4, gpu_minutes=1,
                gpu_util_avg=80.0, gpu_util_max=95.0, gpu_memory_used_avg=1000.0, gpu_memory_total=160000.0,
                gpu_power_avg=900.0, gpu_temp_max=70.0, gpu_sm_clock_avg=1900.0)
    metrics_row(ReplicaMetricsMinute, replica, hour + timedelta(minutes=1), scrapes=4, gpu_devices=2,
                gpu_scrapes=2, gpu_minutes=1, gpu_util_avg=20.0, gpu_util_max=30.0, gpu_memory_used_avg=4000.0,
                gpu_memory_total=160000.0, gpu_power_avg=300.0, gpu_temp_max=60.0, gpu_sm_clock_avg=1000.0)
    # A minute without telemetry weighs nothing: its zeros are "not measured", not "idle".
    metrics_row(ReplicaMetricsMinute, replica, hour + timedelta(minutes=2), scrapes=4)
    retention.rollup_hour(hour)
    row = ReplicaMetricsHour.objects.get(replica=replica, start=hour)
    assert row.scrapes == 12
    assert stats_of(row) == {
        "gpu_devices": 2, "gpu_scrapes": 6, "gpu_minutes": 2,
        "gpu_util_avg": pytest.approx((80 * 4 + 20 * 2) / 6), "gpu_util_max": 95.0,
        "gpu_memory_used_avg": pytest.approx((1000 * 4 + 4000 * 2) / 6), "gpu_memory_total": 160000.0,
        "gpu_power_avg": pytest.approx((900 * 4 + 300 * 2) / 6), "gpu_temp_max": 70.0,
        "gpu_sm_clock_avg": pytest.approx((1900 * 4 + 1000 * 2) / 6)}
    metrics_row(ReplicaMetricsMinute, replica, hour + timedelta(hours=1), scrapes=3)
    retention.rollup_hour(hour + timedelta(hours=1))
    empty = ReplicaMetricsHour.objects.get(replica=replica, start=hour + timedelta(hours=1))
    assert (empty.gpu_devices, empty.gpu_scrapes, empty.gpu_minutes, empty.gpu_util_avg) == (0, 0, 0, 0)


# --- sources ---------------------------------------------------------------------------------


def test_a_local_vllm_replica_gets_its_own_gpus_read_through_nvml(replica, pages, settings, tmp_path, monkeypatch):
    """NVML itself is replayed: runtime.gpu_telemetry.read_gpus is given the recording as its `nvml`."""
    settings.INFEROPS_DATA_DIR = tmp_path
    monkeypatch.setattr(gpu_telemetry, "read_gpus",
                        functools.partial(gpu_telemetry.read_gpus, nvml=ReplayNvml(NVML_H100_X2)))
    page = pages(VLLM_PAGE.read_text())
    replica.url, replica.driver = page.url, DriverName.LOCAL
    replica.identity = {"pid": 1, "node": node_name(), "gpus": ["1"]}
    replica.save()
    marker = replica_marker(installation_id(), replica.pk)
    (tmp_path / "gpus.json").write_text(json.dumps({"0": "another-installation/7", "1": marker}))

    targets = scraping.ready_targets()
    assert targets == [ScrapeTarget(replica.pk, page.url, gpu=GpuSource(devices=("1",), hostname=node_name()))]
    scrape_cycle(targets=targets, fetcher=MetricsFetcher(total_timeout=2.0))
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert (row.gpu_devices, row.gpu_util_avg, row.gpu_memory_used_avg, row.gpu_memory_total, row.gpu_power_avg,
            row.gpu_temp_max, row.gpu_sm_clock_avg) == (1, 34.0, 18211.0, 81558.0, 312.456, 41.0, 1755.0)

    # NVML sees only this node's devices: a replica recorded on another node gets none read here.
    replica.identity = {**replica.identity, "node": "another-node"}
    replica.save()
    assert scraping.ready_targets() == [ScrapeTarget(replica.pk, page.url)]


def test_nvml_without_the_replicas_devices_leaves_a_note_not_a_failure(replica, pages, monkeypatch):
    monkeypatch.setattr(gpu_telemetry, "read_gpus", lambda devices: [])  # NVML gave nothing (no driver)
    page = pages(VLLM_PAGE.read_text())
    (result,) = fetch(ScrapeTarget(replica.pk, page.url, gpu=GpuSource(devices=("0",), hostname="n")))
    assert result.sample is not None and result.sample.gpu is None
    assert result.sample.gpu_note == "NVML (devices 0) reported no GPU series"
    scraping.store_results([result])
    replica.refresh_from_db()
    assert replica.last_error == "" and replica.scrape_state["gpu_note"] == result.sample.gpu_note


def k8s_pod(name: str, node: str, ip: str, labels: dict, namespace: str) -> dict:
    made = pod(name, True, "2026-11-30T10:00:00Z", labels, ip=ip)
    made["metadata"]["namespace"] = namespace
    made["spec"]["nodeName"] = node
    return made


def test_kubernetes_pods_are_read_from_the_dcgm_exporter_on_their_node(replica, pages):
    dcgm = pages(DCGM_PAGE.read_text())
    fake = FakeKubernetesApi()
    try:
        version_labels = {"app.kubernetes.io/name": "inferops", "app.kubernetes.io/component": "replica",
                          "inferops.dev/deployment": "chat", "inferops.dev/version": "1"}
        exporter = {"app.kubernetes.io/name": "dcgm-exporter"}
        fake.pods = [
            k8s_pod(OUR_POD, "gpu-node-1", "10.0.0.7", version_labels, "inferops"),
            k8s_pod("inferops-chat-v1-on-node-2", "gpu-node-2", "10.0.0.9", version_labels, "inferops"),
            k8s_pod("dcgm-exporter-abcde", "gpu-node-1", "127.0.0.1", exporter, "gpu-operator"),
        ]
        replica.driver = DriverName.KUBERNETES
        replica.deployment.resources = {"gpu_type": "nvidia-h100", "gpu_count": 2}
        replica.deployment.save()
        replica.save()
        driver = KubernetesDriver(api_client=fake.api_client(), config=KubernetesSettings(dcgm_port=dcgm.port))
        pods = driver.scrape_pods(replica)
        assert pods == [
            ("http://10.0.0.7:8000", GpuSource(url=f"http://127.0.0.1:{dcgm.port}", pod=OUR_POD,
                                                namespace="inferops")),
            ("http://10.0.0.9:8000", GpuSource(error=(
                "no ready dcgm-exporter pod (app.kubernetes.io/name=dcgm-exporter in namespace gpu-operator) "
                "on node gpu-node-2"))),
        ]
        # The exporters were listed once, in their own namespace, by their label.
        listed = [r for r in fake.requests if r.path == "/api/v1/namespaces/gpu-operator/pods"]
        assert [r.query["labelSelector"] for r in listed] == ["app.kubernetes.io/name=dcgm-exporter"]
        driver.scrape_pods(replica)
        assert len([r for r in fake.requests if r.path == "/api/v1/namespaces/gpu-operator/pods"]) == 1
        # Without GPUs the deployment's pods need no exporter.
        replica.deployment.resources = {}
        assert KubernetesDriver(api_client=fake.api_client()).scrape_pods(replica) == [
            ("http://10.0.0.7:8000", None), ("http://10.0.0.9:8000", None)]
    finally:
        fake.close()

    # The pod's own page is served here in its stead (no pod network on this machine); the exporter's
    # page is fetched once a cycle for every pod on its node.
    replica_page = pages(VLLM_PAGE.read_text())
    source = pods[0][1]
    results = fetch(ScrapeTarget(replica.pk, replica_page.url, pod=replica_page.url, gpu=source),
                    ScrapeTarget(replica.pk, replica_page.url + "/", pod=replica_page.url + "/", gpu=source))
    assert dcgm.requests == 1
    assert [r.sample.gpu for r in results] == [OUR_POD_GPUS, OUR_POD_GPUS]
    scraping.store_results(results[:1])
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert (row.gpu_devices, row.gpu_util_avg, row.gpu_memory_total, row.gpu_temp_max) == (2, 89.0, 161910.0, 64.0)


def test_a_row_holding_two_pods_adds_their_devices(replica):
    one = GpuStats(devices=2, util_percent=90.0, memory_used_mib=100.0, memory_total_mib=1000.0,
                   power_watts=500.0, temp_max_c=60.0, sm_clock_mhz=1900.0)
    two = GpuStats(devices=1, util_percent=30.0, memory_used_mib=50.0, memory_total_mib=500.0,
                   power_watts=200.0, temp_max_c=70.0, sm_clock_mhz=1600.0)
    at = timezone.now() - timedelta(minutes=2)
    scraping.store_results([
        scraping.ScrapeResult(replica.pk, at, scraping.MetricsSample(gpu=one), pod="http://a"),
        scraping.ScrapeResult(replica.pk, at, scraping.MetricsSample(gpu=two), pod="http://b"),
    ])
    row = ReplicaMetricsMinute.objects.get(replica=replica)
    assert (row.gpu_devices, row.gpu_util_avg, row.gpu_memory_used_avg, row.gpu_memory_total, row.gpu_power_avg,
            row.gpu_temp_max, row.gpu_sm_clock_avg) == (3, 70.0, 150.0, 1500.0, 700.0, 70.0, 1800.0)
