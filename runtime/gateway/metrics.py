"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can run
several gateways in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's TTFT and E2E bucket edges (seconds), so gateway and replica histograms line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
# A parked deployment's cold start: a replica process up in seconds, a large model loaded in minutes.
HOLD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 600.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ReplicaLoadCollector(Collector):
    """Outstanding requests and ejection per replica URL, read from the router at scrape time."""

    def __init__(self, read: Callable[[], dict[str, tuple[int, bool]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        outstanding = GaugeMetricFamily("inferops_gateway_upstream_outstanding",
                                        "Requests this gateway has in flight to a replica", labels=["replica"])
        ejected = GaugeMetricFamily("inferops_gateway_upstream_ejected",
                                    "1 while a replica sits out its cool-off after repeated failures",
                                    labels=["replica"])
        for url, (count, is_ejected) in sorted(self.read().items()):
            outstanding.add_metric([url], count)
            ejected.add_metric([url], 1 if is_ejected else 0)
        yield outstanding
        yield ejected


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("inferops_gateway_requests", "Requests answered, by deployment and HTTP status",
                                ["deployment", "status"], registry=r)
        self.ttft = Histogram("inferops_gateway_time_to_first_token_seconds",
                              "Request start to first streamed chunk", ["deployment"], buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("inferops_gateway_time_per_output_token_seconds",
                              "(E2E - TTFT) / (completion tokens - 1) of streamed requests", ["deployment"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("inferops_gateway_e2e_request_latency_seconds", "Request start to last byte",
                             ["deployment"], buckets=E2E_BUCKETS, registry=r)
        self.rate_limited = Counter("inferops_gateway_rate_limited", "Requests refused by a rate limit",
                                    ["scope", "limit"], registry=r)
        self.upstream_errors = Counter("inferops_gateway_upstream_errors",
                                       "Failed upstream attempts (connect, timeout, 5xx)", ["deployment", "kind"],
                                       registry=r)
        self.retries = Counter("inferops_gateway_retries", "Attempts sent to another replica", ["deployment"],
                               registry=r)
        self.shed = Counter("inferops_gateway_shed", "Requests answered 503 before any replica because every "
                            "replica was saturated, none was ready, the degradation level sheds their priority, "
                            "or a parked deployment's hold queue was full (hold_full) or its wait ran out "
                            "(hold_timeout)", ["deployment", "reason"], registry=r)
        self.held = Gauge("inferops_gateway_held_requests",
                          "Requests this gateway holds now while their parked deployment starts a replica",
                          ["deployment"], registry=r)
        self.hold_seconds = Histogram("inferops_gateway_hold_seconds",
                                      "How long requests were held for a parked deployment, by how the hold "
                                      "ended: released, timeout, full, shutdown, gone (the client left)",
                                      ["deployment", "outcome"], buckets=HOLD_BUCKETS, registry=r)
        self.ejections = Counter("inferops_gateway_replica_ejections", "Replicas ejected after repeated failures",
                                 ["deployment"], registry=r)
        self.limits_bypassed = Counter("inferops_gateway_limits_bypassed",
                                       "Requests admitted without rate limits because Redis was unreachable "
                                       "(--redis-down-limits open)", registry=r)
        self.spool_depth = Gauge("inferops_gateway_usage_spool_depth",
                                 "Usage events waiting in the local spool file for Redis", registry=r)
        self.control_plane_requests = Counter(
            "inferops_gateway_control_plane_requests",
            "Files and Batches API requests forwarded to the control plane (or refused before it), by route "
            "(files, batches) and HTTP status", ["route", "status"], registry=r)
        self.redis_up = Gauge("inferops_gateway_redis_up", "1 when the last Redis call succeeded", registry=r)
        self.redis_up.set(1)

    def watch_replicas(self, read: Callable[[], dict[str, tuple[int, bool]]]) -> None:
        self.registry.register(ReplicaLoadCollector(read))
