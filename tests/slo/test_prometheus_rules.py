"""Prometheus rule export: promtool accepts the rules for every SLI kind and source, and
`promtool test rules` shows them paging on a fast burn, staying quiet on a slow one, and holding
back on too little traffic."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deployments.replicas.prometheus_sd import gateway_targets, replica_targets
from inferops.redis_client import redis_client
from runtime.gateway.contract import GATEWAYS_KEY
from runtime.gateway.heartbeat import gateway_entry
from runtime.gateway.metrics import GatewayMetrics
from slo.prometheus_rules import RulesUnavailable, render_rules, rule_groups
from tests.deployments.metrics_helpers import deployment_with_replicas

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is absent: apt-get install prometheus (.ci/deps installs it)")

BASE = {"name": "chat-slo", "scope": "deployment", "objective": 0.99, "window": "1d", "budgeting": "occurrences",
        "min_requests": 20, "description": "", "runbook_url": "https://runbooks.example/chat"}
DEFINITIONS = {
    "availability": {**BASE, "sli_kind": "availability"},
    "latency": {**BASE, "sli_kind": "latency", "ttft_ms": 300.0, "window": "30d"},
    "latency-two-thresholds": {**BASE, "sli_kind": "latency", "ttft_ms": 250.0, "e2e_ms": 5000.0, "window": "7d"},
    "goodput": {**BASE, "sli_kind": "goodput", "ttft_ms": 800.0, "tpot_ms": 50.0, "window": "calendar-month",
                "budgeting": "timeslices", "timeslice_target": 0.95},
    "ratio": {**BASE, "sli_kind": "ratio", "ratio_good": "prefix_cache_hits", "ratio_total": "prefix_cache_queries",
              "window": "28d"},
}
EXPRESSIBLE = [(kind, source) for kind in DEFINITIONS for source in ("gateway", "replica")
               if not (kind == "ratio" and source == "gateway")]


def promtool(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
@pytest.mark.parametrize(("kind", "source"), EXPRESSIBLE)
def test_promtool_accepts_the_rules(kind, source, tmp_path):
    (tmp_path / "rules.yml").write_text(render_rules(DEFINITIONS[kind], ["chat", "chat-canary"], source))
    checked = promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_recordings_cover_the_status_windows_and_the_scaled_alert_windows():
    groups = rule_groups(DEFINITIONS["availability"], ["chat"])["groups"]
    records = {rule["record"] for rule in groups[0]["rules"]}
    for window in ("5m", "30m", "1h", "2h", "6h", "1d", "3d", "1m", "2m", "12m", "48m", "144m"):
        assert f"slo:sli_error:ratio_rate{window}" in records
        assert f"slo:sli_events:increase{window}" in records
    page = groups[1]["rules"][0]
    # A 1-day window: 14.4x over 2m and 1m, 6x over 12m and 1m, each with the traffic guard.
    assert "slo:sli_error:ratio_rate2m{slo=\"chat-slo\"} >= 14.4 * 0.01" in page["expr"]
    assert "slo:sli_events:increase12m{slo=\"chat-slo\"} >= 20" in page["expr"]
    assert page["labels"] == {"slo": "chat-slo", "severity": "page"}
    assert page["annotations"]["runbook_url"] == "https://runbooks.example/chat"


def test_latency_rules_say_they_are_exact_only_at_bucket_edges():
    text = render_rules(DEFINITIONS["latency"], ["chat"])
    assert "exact only at bucket edges" in text
    alert = rule_groups(DEFINITIONS["latency"], ["chat"])["groups"][1]["rules"][0]
    assert "ttft_ms 300 ms judged at the 250 ms bucket edge" in alert["annotations"]["exactness"]
    assert 'le="0.25"' in text
    goodput = rule_groups(DEFINITIONS["goodput"], ["chat"])["groups"][1]["rules"][0]["annotations"]
    assert "upper bound" in goodput["joint_verdicts"] and "timeslices" in goodput["budgeting"]


@pytest.mark.parametrize(("definition", "source", "reason"), [
    (DEFINITIONS["ratio"], "gateway", "source=replica"),
    ({**DEFINITIONS["availability"], "scope": "tenant", "tenant": "acme"}, "gateway", "tenant label"),
    ({**DEFINITIONS["latency"], "ttft_ms": 0.5}, "gateway", "below the smallest histogram bucket"),
    (DEFINITIONS["availability"], "statsd", "gateway or replica"),
])
def test_what_prometheus_cannot_express_is_refused(definition, source, reason):
    with pytest.raises(RulesUnavailable, match=reason):
        rule_groups(definition, ["chat"], source)
    with pytest.raises(RulesUnavailable, match="no deployment"):
        rule_groups(DEFINITIONS["availability"], [])


def requests_series(status: str, per_15s: int) -> dict:
    return {"series": f'inferops_gateway_requests_total{{deployment="chat",status="{status}"}}',
            "values": f"0+{per_15s}x80"}


@needs_promtool
def test_the_rules_page_on_a_fast_burn_only(tmp_path):
    """1-day window, objective 0.99: page at >= 14.4% errors over 2m and 1m, with >= 20 requests."""
    groups = rule_groups(DEFINITIONS["availability"], ["chat"])
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(groups, sort_keys=False))
    page = groups["groups"][1]["rules"][0]
    firing = [{"exp_labels": page["labels"], "exp_annotations": page["annotations"]}]

    def case(series: list[dict], expected: list) -> dict:
        return {"interval": "15s", "input_series": series, "alert_rule_test": [
            {"eval_time": "10m", "alertname": "SLOErrorBudgetBurnPage", "exp_alerts": expected}]}

    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [
        # 20% server errors at 4 requests/s: pages.
        case([requests_series("200", 48), requests_series("500", 12)], firing),
        # 5% server errors: a ticket's worth at most, no page.
        case([requests_series("200", 57), requests_series("503", 3)], []),
        # Client errors are neither good nor bad: 50% 4xx and no 5xx pages nobody.
        case([requests_series("200", 30), requests_series("429", 30)], []),
        # 50% errors but fewer than 5 requests in the longest page window (12m): the traffic guard holds.
        case([{"series": 'inferops_gateway_requests_total{deployment="chat",status="200"}', "values": "0+0.05x80"},
              {"series": 'inferops_gateway_requests_total{deployment="chat",status="500"}', "values": "0+0.05x80"}],
             []),
    ]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_latency_rules_count_requests_above_the_edge_as_slow(tmp_path):
    """TTFT <= 300 ms judged at the 250 ms edge: 30% of requests between 250 ms and 1 s page."""
    definition = {**DEFINITIONS["latency"], "window": "1d"}
    groups = rule_groups(definition, ["chat"])
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(groups, sort_keys=False))
    page = groups["groups"][1]["rules"][0]
    name = "inferops_gateway_time_to_first_token_seconds"
    series = [{"series": f'{name}_bucket{{deployment="chat",le="0.25"}}', "values": "0+7x80"},
              {"series": f'{name}_count{{deployment="chat"}}', "values": "0+10x80"}]
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [{
        "interval": "15s", "input_series": series, "alert_rule_test": [{
            "eval_time": "10m", "alertname": "SLOErrorBudgetBurnPage",
            "exp_alerts": [{"exp_labels": page["labels"], "exp_annotations": page["annotations"]}]}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


VLLM_METRICS = Path(__file__).resolve().parents[2] / "bench/scrape/vllm-0.32-cpu-metrics.txt"
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\[")


def exposed_series(text: str) -> dict[str, set[tuple[str, str]]]:
    """Sample name -> the (label, value) pairs seen on it, from Prometheus text."""
    series: dict[str, set] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels.items())
    return series


def gateway_exposition() -> str:
    metrics = GatewayMetrics()
    metrics.requests.labels("chat", "200").inc()
    metrics.requests.labels("chat", "503").inc()
    for histogram in (metrics.ttft, metrics.tpot, metrics.e2e):
        histogram.labels("chat").observe(0.1)
    return generate_latest(metrics.registry).decode()


def sd_target_labels(component: str) -> dict[str, str]:
    """The labels Prometheus attaches to a target of the SD endpoint (the `__` ones are dropped)."""
    groups = [*replica_targets(), *gateway_targets()]
    labels = next(g["labels"] for g in groups if g["labels"]["component"] == component)
    return {name: value for name, value in labels.items() if not name.startswith("__")}


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "source"), EXPRESSIBLE)
def test_the_rules_read_series_the_gateway_and_vllm_really_expose(kind, source, tiny_llama_dir):
    """Every selector names a sample the real exposition has, with the labels a Prometheus scraping
    the SD endpoint's targets sees on it: the series' own plus the target's."""
    deployment_with_replicas(tiny_llama_dir, replicas=1, name="chat")
    redis_client().hset(GATEWAYS_KEY, "gw-rules", gateway_entry("gw-rules", "127.0.0.1:9"))
    try:
        targets = {component: sd_target_labels(component) for component in ("gateway", "replica")}
    finally:
        redis_client().hdel(GATEWAYS_KEY, "gw-rules")
    if source == "gateway":
        series = exposed_series(gateway_exposition())
    else:
        series = exposed_series(VLLM_METRICS.read_text())
    for name in series:
        series[name] |= set(targets[source].items())
    groups = rule_groups(DEFINITIONS[kind], ["chat"], source)
    selectors = SELECTOR.findall(" ".join(rule["expr"] for rule in groups["groups"][0]["rules"]))
    assert selectors
    for name, matchers in selectors:
        assert name in series, f"{name} is not exposed by the {source}"
        labels = dict(series[name])
        for matcher in matchers.split(", "):
            label, value = re.match(r'(\w+)(?:=~|!~|!=|=)"(.*)"', matcher).groups()
            assert label in labels, f"{name} has no label {label}"
            if label == "deployment":
                assert labels[label] == value == "chat"
            if label == "le":
                assert (label, value) in series[name], f"{name} has no bucket le={value}"
    # A gateway target label named like a series label would rename the series' own (exported_*).
    gateway_labels = {label for pairs in exposed_series(gateway_exposition()).values() for label, _ in pairs}
    assert not set(targets["gateway"]) & gateway_labels
