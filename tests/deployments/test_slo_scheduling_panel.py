"""The engine's SLO scheduling figures from scrape to page: the scraper keeps them apart (empty for a
replica that does not export them), the metrics API draws them, the deployment page sums them up.

The replica's /metrics is the real exposition (runtime.engine.metrics.ServerMetrics) served by a
stub whose counters the test drives, as in test_scraping.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from deployments.models import ReplicaMetricsMinute
from deployments.replicas import scraping
from deployments.replicas.metrics_query import slo_scheduling_summary
from runtime.engine.metrics import ServerMetrics
from runtime.engine.server.settings import ServerSettings, SloTargetSettings
from runtime.engine.slo_scheduling import SlackHistogram, SloTargets
from tests.deployments.metrics_helpers import deployment_with_replicas
from tests.deployments.test_scraping import VLLM_METRICS, MetricsStub, scrape


class SloStub(MetricsStub):
    """A built-in replica under --scheduling-policy slo, TTFT 1.5 s and TPOT 150 ms."""

    def restart(self) -> None:
        super().restart()
        self.stats.scheduling_policy = "slo"
        self.stats.slo_rejected_late_total = 0
        self.stats.slo_demoted_late_total = 0
        self.stats.slo_admission_slack = SlackHistogram()
        settings = ServerSettings(served_model_name="tiny", model_root="/m", scheduling_policy="slo",
                                  slo_targets=SloTargetSettings(SloTargets(1.5, 0.15)))
        self.metrics = ServerMetrics("tiny", lambda: self.stats, settings=settings)

    def judge(self, count: int, *, missed_ttft: int = 0, missed_tpot: int = 0) -> None:
        self.metrics.slo_judged.inc(count)
        self.metrics.slo_misses["ttft"].inc(missed_ttft)
        self.metrics.slo_misses["tpot"].inc(missed_tpot)

    def admit(self, *slacks: float) -> None:
        for slack in slacks:
            self.stats.slo_admission_slack.observe(slack)


class VllmStub(MetricsStub):
    """vLLM 0.32's /metrics as recorded: none of the engine's SLO series."""

    def render(self) -> bytes:
        return VLLM_METRICS.read_bytes()


@pytest.fixture
def stubs():
    made = []

    def make(kind=SloStub):
        made.append(kind())
        return made[-1]

    yield make
    for stub in made:
        stub.close()


@pytest.fixture
def replicas(db, tiny_llama_dir):
    deployment, _, rows = deployment_with_replicas(tiny_llama_dir, replicas=2)
    for row in rows:
        row.started_at = timezone.now() - timedelta(hours=1)
        row.save()
    return deployment, rows


def slo_totals(replica) -> dict:
    totals: dict = {}
    for row in ReplicaMetricsMinute.objects.filter(replica=replica):
        totals = scraping.add_counts(totals, row.slo_scheduling)
    return totals


def test_the_scraper_keeps_slo_counts_as_deltas_across_a_restart_and_none_for_vllm(replicas, stubs):
    deployment, (ours, theirs) = replicas
    slo, vllm_like = stubs(), stubs(VllmStub)
    ours.url, theirs.url = slo.url, vllm_like.url
    ours.save()
    theirs.save()
    slo.judge(5, missed_ttft=1)  # before the first scrape: a baseline only
    scrape(ours, theirs)
    slo.judge(10, missed_ttft=2, missed_tpot=1)
    slo.stats.slo_rejected_late_total += 4
    slo.stats.slo_demoted_late_total += 1
    slo.admit(1.2, 0.4, -0.3)
    scrape(ours, theirs)
    expected = {"judged": 10, "missed_ttft": 2, "missed_tpot": 1, "rejected_late": 4, "served_late": 1,
                "admitted": 3, "admitted_late": 1}
    assert slo_totals(ours) == expected
    assert slo_totals(theirs) == {}  # no data, not zero misses
    slo.restart()
    slo.judge(2, missed_tpot=2)
    scrape(ours, theirs)
    assert slo_totals(ours) == {**expected, "judged": 12, "missed_tpot": 3}
    ours.refresh_from_db()
    (state,) = scraping.targets_from_json(ours.scrape_state).values()
    assert state["slo_info"] == {"policy": "slo", "ttft_target_s": 1.5, "tpot_target_s": 0.15}


def test_the_metrics_api_draws_slo_series_and_null_without_them(replicas, api):
    deployment, (ours, theirs) = replicas
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=2)
    for replica, counts in ((ours, {"judged": 120, "missed_ttft": 6, "rejected_late": 30}), (theirs, {})):
        ReplicaMetricsMinute.objects.create(replica=replica, deployment=deployment, version=replica.version,
                                            start=start, scrapes=4, slo_scheduling=counts)
    client = api("viewer")
    query = {"start": (start - timedelta(minutes=1)).isoformat(), "end": (start + timedelta(minutes=2)).isoformat(),
             "step": 60}
    body = client.get(f"/api/v1/deployments/{deployment.name}/metrics/", {**query, "series": "slo_judged_per_s"}).json()
    assert body["unit"] == "requests/s"
    assert [p[1] for p in body["points"]] == [None, 2.0, None]
    body = client.get(f"/api/v1/deployments/{deployment.name}/metrics/",
                      {**query, "series": "slo_served_late_per_s"}).json()
    assert [p[1] for p in body["points"]] == [None, None, None]  # nobody exported it


def test_the_deployment_page_sums_up_the_last_hour(replicas, stubs, client, make_user):
    deployment, (ours, theirs) = replicas
    client.force_login(make_user("viewer"))
    page = client.get(f"/deployments/{deployment.name}/").content.decode()
    assert "No replica of this deployment exports SLO scheduling figures" in page
    assert slo_scheduling_summary(deployment) is None

    slo = stubs()
    ours.url = slo.url
    ours.save()
    scrape(ours)
    slo.judge(40, missed_ttft=4, missed_tpot=2)
    slo.stats.slo_rejected_late_total += 7
    slo.admit(0.8, -0.1)
    scrape(ours)
    summary = slo_scheduling_summary(deployment)
    assert summary["counts"]["judged"] == 40 and summary["ttft_miss_share"] == 0.1
    assert summary["late_admission_share"] == 0.5
    assert summary["replicas"] == [{"id": ours.pk, "policy": "slo", "ttft_ms": 1500.0, "tpot_ms": 150.0}]
    page = client.get(f"/deployments/{deployment.name}/").content.decode()
    assert "<td>40</td>" in page and "<td>7</td>" in page and "4 (10 %)" in page
    assert f"Replica {ours.pk}: policy <code>slo</code>, targets TTFT 1500.0 ms, TPOT 150.0 ms" in page
    assert 'id="chart-slo_scheduling"' in page
