"""A real Prometheus (Debian's package) discovers a real replica through the SD endpoint of a live
control plane, scrapes it with the SD labels, and evaluates an SLO's exported rules unedited, one
recording rule producing a series that only exists if the rules' `deployment` selector matches.
It scrapes the control plane's own /metrics with the same viewer token."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from rest_framework.authtoken.models import Token

from deployments.models import Replica
from slo.prometheus_rules import render_rules
from tests.conftest import free_port
from tests.deployments.metrics_helpers import deployment_with_replicas
from tests.processes import stop_process
from tests.services import Process
from tests.waiting import wait_until

PROMETHEUS = "/usr/bin/prometheus"
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not Path(PROMETHEUS).exists(),
                       reason="/usr/bin/prometheus is absent: apt-get install prometheus (.ci/deps installs it)"),
]
SLO = {"name": "chat-availability", "scope": "deployment", "sli_kind": "availability", "objective": 0.99,
       "window": "1d", "budgeting": "occurrences", "min_requests": 20, "description": "", "runbook_url": ""}


STARTING = (httpx.TransportError,)  # Prometheus refuses connections while it starts


def logged(what: str, log: Path):
    """A wait's description with the tail of Prometheus' log, read if the wait fails."""
    return lambda: f"{what}; prometheus log:\n{log.read_text()[-4000:]}"


@pytest.fixture
def prometheus(tmp_path):
    processes = []

    def start(config: dict, rules: str) -> str:
        (tmp_path / "rules.yml").write_text(rules)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({**config, "rule_files": ["rules.yml"]}))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "w")
        processes.append((subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-lifecycle"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path), log))
        return f"http://127.0.0.1:{port}"

    yield start
    for process, log in processes:
        stop_process(process)
        log.close()


def test_prometheus_scrapes_the_sd_targets_and_evaluates_the_exported_rules(
        live_server, transactional_db, make_user, tiny_llama_dir, prometheus, tmp_path):
    port = free_port()
    replica = Process(["serve", "--model", str(tiny_llama_dir), "--port", str(port), "--served-model-name", "chat",
                       "--max-model-len", "256", "--cpu-threads", "1", "--log-level", "warning"],
                      tmp_path / "replica.log", f"http://127.0.0.1:{port}/health")
    try:
        _, _, (row,) = deployment_with_replicas(tiny_llama_dir, replicas=1, name="chat")
        Replica.objects.filter(pk=row.pk).update(url=f"http://127.0.0.1:{port}")
        token = Token.objects.create(user=make_user("viewer")).key
        base = prometheus({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "inferops", "http_sd_configs": [{
                    "url": f"{live_server.url}/api/v1/prometheus/sd/", "refresh_interval": "1s",
                    "authorization": {"credentials": token}}]},
                # The control plane's own /metrics, with the same viewer token.
                {"job_name": "inferops-control-plane", "authorization": {"credentials": token},
                 "static_configs": [{"targets": [urlsplit(live_server.url).netloc]}]},
            ],
        }, render_rules(SLO, ["chat"], source="replica"))
        log = tmp_path / "prometheus.log"
        replica.wait_healthy()

        def replica_target_up():
            active = httpx.get(f"{base}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            return next((t for t in active if t["labels"].get("component") == "replica"
                         and t["health"] == "up"), None)

        target = wait_until(replica_target_up, logged("the replica target to be up", log), 45, 0.5, ignore=STARTING)
        assert {k: target["labels"][k] for k in ("deployment", "version", "replica", "track", "backend")} == {
            "deployment": "chat", "version": "1", "replica": str(row.pk), "track": "stable", "backend": "builtin"}
        assert target["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"

        def rules_evaluated():
            groups = httpx.get(f"{base}/api/v1/rules", timeout=2).json()["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            evaluated = rules and all(rule["health"] == "ok" and rule["lastEvaluation"] > "2000" for rule in rules)
            return rules if evaluated else None

        rules = wait_until(rules_evaluated, logged("every rule evaluated with health ok", log), 20, 0.5,
                           ignore=STARTING)
        assert {rule["type"] for rule in rules} == {"recording", "alerting"}

        # The events recording sums vllm:request_success_total{deployment="chat"}: a series only when
        # the SD target label matched the rules' selector (an empty selection records nothing).
        def recorded():
            query = 'slo:sli_events:increase1m{slo="chat-availability"}'
            return httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=2).json()["data"]["result"]

        (series,) = wait_until(recorded, logged("the recording rule's series", log), 20, 0.5, ignore=STARTING)
        assert float(series["value"][1]) == 0  # no traffic yet: an increase of zero, not an absent series

        def control_plane_scraped():
            query = 'inferops_alerts_open{job="inferops-control-plane", severity="page", status="firing"}'
            return httpx.get(f"{base}/api/v1/query", params={"query": query}, timeout=2).json()["data"]["result"]

        (alerts,) = wait_until(control_plane_scraped, logged("the control plane's /metrics to be scraped", log), 20,
                               0.5, ignore=STARTING)
        assert float(alerts["value"][1]) == 0
    finally:
        replica.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is absent")
def test_the_rules_would_record_nothing_without_the_deployment_label(tmp_path):
    """The counterpart the test above relies on: the same rule over a series lacking the label is empty."""
    series = {"series": 'vllm:request_success_total{finished_reason="stop", model_name="chat"}', "values": "0+1x10"}
    (tmp_path / "rules.yml").write_text(render_rules(SLO, ["chat"], source="replica"))
    (tmp_path / "test.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [series], "promql_expr_test": [
            {"expr": 'slo:sli_events:increase5m{slo="chat-availability"}', "eval_time": "5m", "exp_samples": []}]}],
    }))
    run = subprocess.run(["promtool", "test", "rules", "test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
