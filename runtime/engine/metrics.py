"""Prometheus metrics for a replica, under vLLM's names so one scraper serves both backends.

Latency histograms are observed per request by the server. Gauges and engine counters are read
from the engine's `stats()` at scrape time by a custom collector, so a scrape always sees the
current value and the engine never has to push anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.gpu_telemetry import GpuCollector

# vLLM 0.32's default buckets (bench/scrape/vllm-0.32-cpu-metrics.txt, as recorded).
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
DEFAULT_BUCKETS: dict[str, tuple[float, ...]] = {
    "ttft": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
             7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "itl": _TOKEN_GAP_BUCKETS,
    "tpot": _TOKEN_GAP_BUCKETS,
    "e2e": _LATENCY_BUCKETS,
    "queue": _LATENCY_BUCKETS,
    "prefill": _LATENCY_BUCKETS,
    "decode": _LATENCY_BUCKETS,
    "inference": _LATENCY_BUCKETS,
}
# vLLM's 1-2-5 request length buckets up to max_model_len (2048 here, as recorded).
TOKEN_COUNT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)

FINISH_REASONS = ("stop", "length", "abort", "error")

# (metric name without _total, help, attribute of engine.stats())
_ENGINE_COUNTERS = (
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("vllm:generation_tokens", "Number of generation tokens processed.",
     "generation_tokens_total"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     "num_preemptions_total"),
    ("vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits_total"),
)
_ENGINE_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches.",
     "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
)

LABEL_NAMES = ("engine", "model_name")


class EngineStatsCollector(Collector):
    """Reads the engine's gauges and counters when Prometheus scrapes."""

    def __init__(self, model_name: str, read_stats: Callable[[], Any | None],
                 settings: Any | None = None) -> None:
        self.labels = ["0", model_name]
        self.read_stats = read_stats
        self.settings = settings  # ServerSettings: the policy and the replica-wide targets

    def collect(self) -> Iterable[Metric]:
        # Before the model has loaded there are no stats; report zeros so series exist early.
        stats = self.read_stats()
        for name, help_text, attribute in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=LABEL_NAMES)
            family.add_metric(self.labels, float(getattr(stats, attribute, 0) or 0))
            yield family
        for name, help_text, attribute in _ENGINE_COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=LABEL_NAMES)
            family.add_metric(self.labels, float(getattr(stats, attribute, 0) or 0))
            yield family
        yield from self._slo_scheduling(stats)

    def _slo_scheduling(self, stats: Any | None) -> Iterable[Metric]:
        """What SLO scheduling does (generative replicas only): its policy and targets, requests
        refused or served late, and the slack requests had when first admitted (slo policy)."""
        settings = self.settings
        if settings is None or not hasattr(stats, "scheduling_policy"):
            return
        info = GaugeMetricFamily("inferops:scheduling_policy_info", "The engine's scheduling policy.",
                                 labels=(*LABEL_NAMES, "policy"))
        info.add_metric([*self.labels, settings.scheduling_policy], 1.0)
        yield info
        targets = settings.slo_targets.effective
        for phase, value in (("ttft", targets.ttft_s), ("tpot", targets.tpot_s)):
            if value is not None:
                gauge = GaugeMetricFamily(f"inferops:slo_target_{phase}_seconds",
                                          f"The replica-wide {phase.upper()} target of requests that bring none.",
                                          labels=LABEL_NAMES)
                gauge.add_metric(self.labels, value)
                yield gauge
        for name, help_text, attribute in (
                ("inferops:slo_rejected_late", "Requests refused (503) because they could no longer meet "
                                               "their TTFT target (--slo-reject-late).", "slo_rejected_late_total"),
                ("inferops:slo_served_late", "Requests found unable to meet their TTFT target and served "
                                             "after those that could.", "slo_demoted_late_total")):
            family = CounterMetricFamily(name, help_text, labels=LABEL_NAMES)
            family.add_metric(self.labels, float(getattr(stats, attribute, 0) or 0))
            yield family
        slack = getattr(stats, "slo_admission_slack", None)
        if slack is not None:
            family = HistogramMetricFamily(
                "inferops:slo_admission_slack_seconds",
                "Time left to a request's TTFT deadline less its estimated prefill, when first admitted "
                "(negative: already late).", labels=LABEL_NAMES)
            family.add_metric(self.labels, slack.cumulative(), slack.sum)
            yield family


class PreciseProcessCollector(ProcessCollector):
    """prometheus_client's process_* series, with the boot time read to the 10 ms of /proc/uptime
    instead of the whole second of /proc/stat's btime, so process_start_time_seconds can time a
    cold start's first phase (often well under a second)."""

    def _boot_time(self) -> float:
        with open(os.path.join(self._proc, "uptime"), "rb") as uptime:
            return time.time() - float(uptime.read().split()[0])


class ColdStartCollector(Collector):
    """When this process finished loading its weights and sent its first output (Unix seconds, 0 until
    then): with process_start_time_seconds, the phases of its cold start (docs/serving.md)."""

    def __init__(self, model_name: str, loaded_at: Callable[[], float | None],
                 first_output_at: Callable[[], float | None]) -> None:
        self.labels = ["0", model_name]
        self.loaded_at = loaded_at
        self.first_output_at = first_output_at

    def collect(self) -> Iterable[Metric]:
        for name, help_text, read in (
                ("inferops:weights_loaded_time_seconds",
                 "When the model's weights finished loading, in Unix seconds (0 while loading).", self.loaded_at),
                ("inferops:first_token_time_seconds",
                 "When this process sent its first generated token (an embedding model: its first embedding), "
                 "in Unix seconds (0 until then).", self.first_output_at)):
            family = GaugeMetricFamily(name, help_text, labels=LABEL_NAMES)
            family.add_metric(self.labels, read() or 0.0)
            yield family


class ServerMetrics:
    """The replica's private registry: request histograms plus the engine, cold-start and GPU collectors.

    `gpu_collector` (default: the devices of this process's CUDA_VISIBLE_DEVICES, read through NVML)
    serves dcgm-exporter's series; it yields none on a replica without GPUs.
    """

    def __init__(self, model_name: str, read_stats: Callable[[], Any | None],
                 buckets: dict[str, tuple[float, ...]] | None = None, settings: Any | None = None,
                 loaded_at: Callable[[], float | None] = lambda: None,
                 gpu_collector: Collector | None = None) -> None:
        chosen = {**DEFAULT_BUCKETS, **(buckets or {})}
        self.registry = CollectorRegistry()
        # process_start_time_seconds (and the other process_* series vLLM exposes too) lets the
        # scraper tell a restarted replica from one whose counters merely grew.
        PreciseProcessCollector(registry=self.registry)
        self.first_output_at: float | None = None
        labels = {"engine": "0", "model_name": model_name}

        def histogram(name: str, help_text: str, key: str) -> Histogram:
            return Histogram(name, help_text, labelnames=LABEL_NAMES, buckets=chosen[key],
                             registry=self.registry).labels(**labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", "ttft")
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", "itl")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", "tpot")
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", "e2e")
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", "queue")
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", "prefill")
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", "decode")
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", "inference")
        self.prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labelnames=LABEL_NAMES,
            buckets=TOKEN_COUNT_BUCKETS, registry=self.registry).labels(**labels)
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            labelnames=LABEL_NAMES, buckets=TOKEN_COUNT_BUCKETS, registry=self.registry).labels(**labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=("engine", "finished_reason", "model_name"),
                          registry=self.registry)
        # Pre-create every reason so rate() over a reason that has not happened yet is 0.
        self.request_success = {
            reason: success.labels(engine="0", finished_reason=reason, model_name=model_name)
            for reason in FINISH_REASONS}
        self.slo_judged = Counter("inferops:slo_requests_judged",
                                  "Finished requests judged against their TTFT and TPOT targets.",
                                  labelnames=LABEL_NAMES, registry=self.registry).labels(**labels)
        misses = Counter("inferops:slo_deadline_misses", "Finished requests that missed a target, by phase.",
                         labelnames=(*LABEL_NAMES, "phase"), registry=self.registry)
        self.slo_misses = {phase: misses.labels(phase=phase, **labels) for phase in ("ttft", "tpot")}
        self.registry.register(EngineStatsCollector(model_name, read_stats, settings))
        self.registry.register(ColdStartCollector(model_name, loaded_at, lambda: self.first_output_at))
        self.registry.register(GpuCollector() if gpu_collector is None else gpu_collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)

    def on_output(self) -> None:
        """An output left (a token, or an embedding): the first one ends the process's cold start."""
        if self.first_output_at is None:
            self.first_output_at = time.time()


class RequestTimer:
    """Timestamps of one request, turned into histogram observations as they happen.

    Definitions follow `vllm bench serve`: TTFT from arrival to the first output token, ITL
    between output chunks, TPOT = (E2E - TTFT) / (output tokens - 1). Phases follow vLLM's:
    queue (arrival to scheduled), prefill (scheduled to first token), decode (first token to
    the end), inference (scheduled to the end).
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrived_at = time.monotonic()
        self.scheduled_at: float | None = None
        self.num_prompt_tokens = 0  # set by the server once the prompt is tokenized
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finished = False
        self.targets: Any = None  # SloTargets the request was scheduled for (generation only)

    def on_scheduled(self, step_started_at: float) -> None:
        """The first engine step that produced output for this request began at this time.

        The engine does not report when it first scheduled a request, so queue time ends at
        the step that sampled the first token: exact for prompts prefilled in one step; for a
        prompt chunked over several steps it also holds the earlier chunks' time.
        """
        if self.first_token_at is None:
            self.scheduled_at = max(self.arrived_at, step_started_at)
            self.metrics.queue.observe(self.scheduled_at - self.arrived_at)

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrived_at)
            self.metrics.on_output()
        else:
            self.metrics.itl.observe(now - (self.last_token_at or now))
        self.last_token_at = now
        self.num_output_tokens += num_tokens

    def on_finished(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        if reason == "late":  # refused, not served: counted by the engine (inferops:slo_rejected_late)
            return
        self.metrics.request_success[reason if reason in FINISH_REASONS else "stop"].inc()
        if reason in ("abort", "error"):
            return
        metrics = self.metrics
        self._judge(now)
        metrics.e2e.observe(now - self.arrived_at)
        metrics.prompt_tokens.observe(self.num_prompt_tokens)
        metrics.generation_tokens.observe(self.num_output_tokens)
        if self.first_token_at is not None and self.num_output_tokens > 1:
            metrics.tpot.observe((now - self.first_token_at) / (self.num_output_tokens - 1))
        if self.first_token_at is not None and self.scheduled_at is not None:
            metrics.prefill.observe(self.first_token_at - self.scheduled_at)
            metrics.decode.observe(now - self.first_token_at)
            metrics.inference.observe(now - self.scheduled_at)

    def _judge(self, now: float) -> None:
        """Count a finished request against its targets: TTFT from arrival, TPOT as the mean gap."""
        targets = self.targets
        if targets is None or self.first_token_at is None:
            return
        metrics = self.metrics
        metrics.slo_judged.inc()
        if targets.ttft_s is not None and self.first_token_at - self.arrived_at > targets.ttft_s:
            metrics.slo_misses["ttft"].inc()
        if targets.tpot_s is not None and self.num_output_tokens > 1 and \
                (now - self.first_token_at) / (self.num_output_tokens - 1) > targets.tpot_s:
            metrics.slo_misses["tpot"].inc()
