"""platform/grafana: every dashboard query names a metric the project really exports, read from the
live registries (the gateway's, a replica's and the control plane's collector), never from a list
kept by hand; the replica panels also name only what vLLM itself exports, so they fill in for vLLM
replicas. Provisioning files point the dashboards at the datasource they refer to."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from project.metrics import registry as control_plane_registry
from runtime.engine.metrics import ServerMetrics
from runtime.gateway.metrics import GatewayMetrics

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "platform/grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
VLLM_SCRAPE = REPO / "bench/scrape/vllm-0.32-cpu-metrics.txt"

# PromQL words that look like identifiers but name no metric.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
            "atan2", "inf", "nan", "start", "end"}
# Label lists after these words are label names, not metrics.
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
TOKEN = re.compile(r"(?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?:[smhdwy]|ms)*)"
                   r"|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<call>\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not called as functions,
    not label names (inside {} or a by/without/on list), not keywords, not numbers or durations."""
    text = STRING.sub('""', expr)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "1", text)  # Grafana variables ($__rate_interval, ${x})
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = GROUPING.sub(" ", text)
    names = set()
    for token in TOKEN.finditer(text):
        name = token.group("name")
        if name and not token.group("call") and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def sample_names(families) -> set[str]:
    """The sample names families expose, by type: counter `_total`, histogram `_bucket/_sum/_count`."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
                "gauge": ("",), "info": ("_info",), "unknown": ("",), "stateset": ("",)}
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def exported_names() -> set[str]:
    gateway = GatewayMetrics()
    gateway.watch_replicas(lambda: {})
    replica = ServerMetrics("chat", lambda: None)
    names = set()
    for registry in (gateway.registry, replica.registry, control_plane_registry()):
        names |= sample_names(registry.collect())
    return names


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    found = [(f"panel {panel['title']!r}", target["expr"]) for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if variable.get("type") == "query" and query:
            # label_values(<selector>, <label>): only the selector is PromQL.
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            found.append((f"variable {variable['name']!r}", selector.group(1) if selector else query))
    return found


def unknown_metrics(dashboard: dict, known: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, expr in queries(dashboard) for name in sorted(metric_names(expr))
            if name not in known]


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{deployment=~"$d"}'
     '[$__rate_interval])))', {"vllm:time_to_first_token_seconds_bucket"}),
    ('sum by (status, deployment) (rate(a_total{status=~"5..", le="0.5"}[5m] offset 1h)) / on (deployment) '
     'group_left (x) b', {"a_total", "b"}),
    ("1 - increase(good_total[1h]) / increase(total_total[1h:1m]) > 1e-3 and bool c or inf", {"good_total",
                                                                                              "total_total", "c"}),
    ('label_replace(up, "by", "x", "rate", "(.*)")', {"up"}),
    ("max without (replica) (kv) * 100 unless count(nan_metric) == 0x1f", {"kv", "nan_metric"}),
])
def test_the_tokenizer_finds_metric_names_only(expr, names):
    assert metric_names(expr) == names


@pytest.mark.django_db
def test_every_query_names_an_exported_metric():
    known = exported_names()
    # The collectors really were read: one family of each source must be there.
    assert {"vllm:kv_cache_usage_perc", "inferops_gateway_requests_total",
            "inferops_slo_error_budget_remaining_ratio"} <= known
    assert len(DASHBOARDS) == 3
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert queries(dashboard), path.name
        assert unknown_metrics(dashboard, known) == [], path.name


def test_replica_panels_name_only_what_vllm_exports():
    vllm = sample_names(text_string_to_metric_families(VLLM_SCRAPE.read_text()))
    dashboard = json.loads((GRAFANA / "dashboards/replicas.json").read_text())
    names = {name for _, expr in queries(dashboard) for name in metric_names(expr)}
    assert names and all(name.startswith("vllm:") for name in names)
    assert unknown_metrics(dashboard, vllm) == []


@pytest.mark.django_db
def test_a_misspelled_metric_is_caught():
    known = exported_names()
    dashboard = json.loads((GRAFANA / "dashboards/gateway.json").read_text())
    target = dashboard["panels"][0]["targets"][0]
    target["expr"] = target["expr"].replace("inferops_gateway_requests_total", "inferops_gateway_request_total")
    assert unknown_metrics(dashboard, known) == [f"panel {dashboard['panels'][0]['title']!r}: "
                                                 "inferops_gateway_request_total"]
    # A histogram's suffix on a gauge is no metric either.
    target["expr"] = "rate(inferops_gateway_upstream_outstanding_bucket[5m])"
    assert unknown_metrics(dashboard, known) == [f"panel {dashboard['panels'][0]['title']!r}: "
                                                 "inferops_gateway_upstream_outstanding_bucket"]


def test_provisioning_points_the_dashboards_at_their_datasource():
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/inferops.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and datasources["apiVersion"] == 1
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/inferops.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]
        refs = [panel["datasource"] for panel in dashboard["panels"]]
        refs += [t["datasource"] for panel in dashboard["panels"] for t in panel["targets"]]
        refs += [v["datasource"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
        assert {(ref["type"], ref["uid"]) for ref in refs} == {("prometheus", source["uid"])}, path.name
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids)), path.name


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is absent: apt-get install prometheus")
def test_every_panel_query_is_valid_promql(tmp_path):
    """promtool parses each query as a recording rule's expression, Grafana's variables filled in."""
    rules = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "5m")
                rules.append({"record": f"dashboard:{path.stem}:{panel['id']}{target['refId']}",
                              "expr": re.sub(r"\$\w+", ".*", expr)})
    (tmp_path / "panels.yml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", "panels.yml"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(rules)} rules found" in checked.stdout
