"""Prometheus recording and multiwindow burn-rate alerting rules for one SLO.

For teams that alert from their own Prometheus: the rules read the gateway's metrics
(`inferops_gateway_*`, labelled by `deployment` by the gateway itself) or the replicas' vLLM metrics
(`vllm:*`, which get `deployment` as a target label from inferops' service-discovery endpoint,
deployments/replicas/prometheus_sd.py, with `version`, `replica` and `track`), so a Prometheus scraping the
SD targets evaluates them unedited. They record the SLI's error ratio over every
window the alerts need, and page or ticket on the same scaled multiwindow table inferops itself
evaluates (`slo.budget.alert_rules`).

What a Prometheus can and cannot see, said in the rules' annotations:
- A latency verdict read from a histogram is exact only at a bucket edge. The rules count a
  request as fast when it fell in a bucket whose upper edge is at or below the threshold, so with
  a threshold between two edges the requests between the lower edge and the threshold count as
  slow: the rules alert early, never late. inferops' own evaluation judges every request.
- Per-request joint verdicts (goodput, several latency thresholds at once) do not exist as
  metrics; the error ratio is the sum of the parts (a union bound, capped at 1), again erring on
  the side of alerting.
- Prometheus counts occurrences; an SLO budgeted in timeslices alerts here on its event ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from prometheus_client.utils import floatToGoString

from runtime.gateway.metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from slo.budget import BURN_WINDOWS, alert_rules
from slo.choices import Scope, SliKind

SOURCES = ("gateway", "replica")
# vLLM's TTFT, TPOT and E2E buckets are the gateway's (runtime/gateway/metrics.py copies them).
BUCKETS = {"ttft_ms": TTFT_BUCKETS, "tpot_ms": TPOT_BUCKETS, "e2e_ms": E2E_BUCKETS}
HISTOGRAMS = {
    "gateway": {"ttft_ms": "inferops_gateway_time_to_first_token_seconds",
                "tpot_ms": "inferops_gateway_time_per_output_token_seconds",
                "e2e_ms": "inferops_gateway_e2e_request_latency_seconds"},
    "replica": {"ttft_ms": "vllm:time_to_first_token_seconds",
                "tpot_ms": "vllm:request_time_per_output_token_seconds",
                "e2e_ms": "vllm:e2e_request_latency_seconds"},
}
# Ratio SLIs name ReplicaMetricsMinute counters; these are the vLLM series they were scraped from.
RATIO_SERIES_METRICS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
    "itl_count": "vllm:inter_token_latency_seconds_count",
    "e2e_count": "vllm:e2e_request_latency_seconds_count",
}
ERROR_RECORD = "slo:sli_error:ratio_rate{window}"
EVENTS_RECORD = "slo:sli_events:increase{window}"


class RulesUnavailable(ValueError):
    """The SLO cannot be expressed on the chosen metrics (the message says why and what instead)."""


def promql_duration(minutes: int) -> str:
    for unit, size in (("d", 1440), ("h", 60)):
        if minutes % size == 0:
            return f"{minutes // size}{unit}"
    return f"{minutes}m"


@dataclass(frozen=True)
class SliQuery:
    """PromQL builders for one SLO's SLI on one metric source."""

    definition: dict
    source: str
    selector: str

    def errors(self, window: str) -> str:
        kind = self.definition["sli_kind"]
        if kind == SliKind.AVAILABILITY:
            return self.availability_errors(window)
        if kind == SliKind.RATIO:
            good, total = (RATIO_SERIES_METRICS[self.definition[key]] for key in ("ratio_good", "ratio_total"))
            return f"1 - ({self.sum_rate(good, window)} / {self.sum_rate(total, window)})"
        parts = [self.latency_errors(field_name, window) for field_name in BUCKETS
                 if self.definition.get(field_name) is not None]
        if kind == SliKind.GOODPUT:
            parts.insert(0, self.availability_errors(window))
        if len(parts) == 1:
            return parts[0]
        return "clamp_max(" + " + ".join(f"({part})" for part in parts) + ", 1)"

    def events(self, window: str) -> str:
        kind = self.definition["sli_kind"]
        if kind == SliKind.RATIO:
            return self.sum_increase(RATIO_SERIES_METRICS[self.definition["ratio_total"]], window)
        if kind == SliKind.LATENCY:
            first = next(name for name in BUCKETS if self.definition.get(name) is not None)
            return self.sum_increase(f"{HISTOGRAMS[self.source][first]}_count", window)
        metric, matcher = self.availability_total_metric()
        return self.sum_increase(metric, window, matcher)

    def availability_errors(self, window: str) -> str:
        if self.source == "gateway":
            bad = self.sum_rate("inferops_gateway_requests_total", window, 'status=~"5.."')
        else:
            bad = self.sum_rate("vllm:request_success_total", window, 'finished_reason="error"')
        metric, matcher = self.availability_total_metric()
        return f"{bad} / {self.sum_rate(metric, window, matcher)}"

    def availability_total_metric(self) -> tuple[str, str]:
        # Client errors (4xx at the gateway, aborts at a replica) count neither good nor bad.
        if self.source == "gateway":
            return "inferops_gateway_requests_total", 'status!~"4.."'
        return "vllm:request_success_total", 'finished_reason!="abort"'

    def latency_errors(self, field_name: str, window: str) -> str:
        histogram = HISTOGRAMS[self.source][field_name]
        edge = bucket_edge(field_name, self.definition[field_name])
        total = self.sum_rate(f"{histogram}_count", window)
        fast = self.sum_rate(f"{histogram}_bucket", window, f'le="{floatToGoString(edge)}"')
        return f"({total} - {fast}) / {total}"

    def sum_rate(self, metric: str, window: str, matcher: str = "") -> str:
        return f"sum(rate({metric}{{{self.matchers(matcher)}}}[{window}]))"

    def sum_increase(self, metric: str, window: str, matcher: str = "") -> str:
        return f"sum(increase({metric}{{{self.matchers(matcher)}}}[{window}]))"

    def matchers(self, extra: str) -> str:
        return ", ".join(part for part in (self.selector, extra) if part)


def bucket_edge(field_name: str, threshold_ms: float) -> float:
    """The largest bucket edge (seconds) at or below the threshold."""
    edges = [edge for edge in BUCKETS[field_name] if edge * 1000 <= threshold_ms + 1e-9]
    if not edges:
        smallest = BUCKETS[field_name][0] * 1000
        raise RulesUnavailable(f"{field_name} {threshold_ms:g} ms lies below the smallest histogram bucket "
                               f"({smallest:g} ms): no Prometheus rule can judge it.")
    return edges[-1]


def deployment_selector(deployments: list[str]) -> str:
    if not deployments:
        raise RulesUnavailable("The SLO covers no deployment yet: there is nothing to select in Prometheus.")
    if len(deployments) == 1:
        return f'deployment="{deployments[0]}"'
    return f'deployment=~"{"|".join(sorted(deployments))}"'


def check_expressible(definition: dict, source: str) -> None:
    if source not in SOURCES:
        raise RulesUnavailable(f"Unknown source {source!r}: use gateway or replica.")
    kind = definition["sli_kind"]
    if kind == SliKind.QUALITY:
        raise RulesUnavailable("A quality SLI is the pass rate of inferops' eval runs, which no Prometheus metric "
                               "carries: inferops evaluates it and pages when the latest run scores below the floor.")
    if kind == SliKind.RATIO and source == "gateway":
        raise RulesUnavailable("A ratio SLI reads scraped replica series: use source=replica.")
    if definition.get("scope") == Scope.TENANT:
        raise RulesUnavailable("Neither the gateway's nor the replicas' metrics carry a tenant label; "
                               "inferops evaluates tenant SLOs from its usage ledger only.")


def rule_groups(definition: dict, deployments: list[str], source: str = "gateway") -> dict:
    """The rule file's content: a recording group and an alerting group for one SLO."""
    check_expressible(definition, source)
    name = definition["name"]
    query = SliQuery(definition, source, deployment_selector(deployments))
    rules = alert_rules(definition["window"])
    minutes = sorted(set(BURN_WINDOWS.values()) | {m for rule in rules for m in (rule.long_minutes,
                                                                                 rule.short_minutes)})
    labels = {"slo": name}
    recording = []
    for window in map(promql_duration, minutes):
        recording.append({"record": ERROR_RECORD.format(window=window), "expr": query.errors(window),
                          "labels": dict(labels)})
        recording.append({"record": EVENTS_RECORD.format(window=window), "expr": query.events(window),
                          "labels": dict(labels)})
    budget = 1 - definition["objective"]
    alerting = []
    for severity in ("page", "ticket"):
        conditions = [burn_condition(name, rule, budget, definition.get("min_requests", 20))
                      for rule in rules if rule.severity == severity]
        alerting.append({
            "alert": f"SLOErrorBudgetBurn{severity.title()}",
            "expr": "\nor\n".join(conditions),
            "labels": {"slo": name, "severity": severity},
            "annotations": annotations(definition, source, severity, rules),
        })
    return {"groups": [{"name": f"slo-{name}-sli", "rules": recording},
                       {"name": f"slo-{name}-burn-rate", "rules": alerting}]}


def burn_condition(name: str, rule, budget: float, min_requests: int) -> str:
    threshold = f"{rule.factor:g} * {budget:.6g}"
    long_window, short_window = promql_duration(rule.long_minutes), promql_duration(rule.short_minutes)
    selector = f'{{slo="{name}"}}'
    return (f"(\n  {ERROR_RECORD.format(window=long_window)}{selector} >= {threshold}\n"
            f"  and\n  {ERROR_RECORD.format(window=short_window)}{selector} >= {threshold}\n"
            # The minimum-traffic guard: a handful of requests in the long window pages nobody.
            f"  and\n  {EVENTS_RECORD.format(window=long_window)}{selector} >= {min_requests}\n)")


def annotations(definition: dict, source: str, severity: str, rules) -> dict:
    table = "; ".join(f"{rule.factor:g}x over {promql_duration(rule.long_minutes)} and "
                      f"{promql_duration(rule.short_minutes)}" for rule in rules if rule.severity == severity)
    notes = {
        "summary": f"SLO {definition['name']} is burning its error budget ({severity}: {table}).",
        "description": (f"Objective {definition['objective']:g} over {definition['window']}, "
                        f"{definition['sli_kind']} SLI read from the {source}'s metrics."),
    }
    thresholds = {name: definition[name] for name in BUCKETS if definition.get(name) is not None}
    if thresholds:
        edges = ", ".join(f"{name} {value:g} ms judged at the {bucket_edge(name, value) * 1000:g} ms bucket edge"
                          for name, value in thresholds.items())
        notes["exactness"] = (f"Histogram buckets are exact only at their edges: {edges}. "
                              "Requests between that edge and the threshold count as slow here; "
                              "inferops' own evaluation judges each request exactly.")
    if definition["sli_kind"] == SliKind.GOODPUT or len(thresholds) > 1:
        notes["joint_verdicts"] = ("Metrics hold no per-request joint verdict: the error ratio is the sum "
                                   "of its parts, capped at 1 (an upper bound).")
    if definition.get("budgeting") == "timeslices":
        notes["budgeting"] = "Prometheus judges occurrences; inferops budgets this SLO in one-minute timeslices."
    if definition.get("runbook_url"):
        notes["runbook_url"] = definition["runbook_url"]
    return notes


HEADER = """\
# Prometheus rules for the inferops SLO {name} ({source} metrics), written by inferops.
# Check with: promtool check rules <file>
# Latency SLIs read from histograms are exact only at bucket edges (see each alert's annotations).
"""


class RulesDumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, long ones unfolded: the file stays readable."""

    def represent_str(self, value: str):
        style = "|" if "\n" in value else None
        return self.represent_scalar("tag:yaml.org,2002:str", value, style=style)


RulesDumper.add_representer(str, RulesDumper.represent_str)


def render_rules(definition: dict, deployments: list[str], source: str = "gateway") -> str:
    groups = rule_groups(definition, deployments, source)
    body = yaml.dump(groups, Dumper=RulesDumper, sort_keys=False, allow_unicode=True, width=100_000)
    return HEADER.format(name=definition["name"], source=source) + body


def slo_rules(slo, source: str = "gateway") -> str:
    """The rule file for an Slo row; raises RulesUnavailable when its SLI has no Prometheus form."""
    from slo.openslo import definition_from_slo

    return render_rules(definition_from_slo(slo), slo.deployment_names(), source)
