"""Scrape every ready replica's Prometheus `/metrics` into per-replica, per-minute rows.

Built-in and vLLM replicas expose the same vLLM metric names, so one parser serves both. A cycle
has two phases: fetch all replicas concurrently (bounded, with timeouts, so one slow or dead
replica costs only its own timeout), then store every sample in short transactions. One cycle
runs at a time (a Postgres advisory lock); a cycle that finds another running skips its turn.

Counters and histograms are stored as deltas since the replica's previous scrape, whose raw
values live in `Replica.scrape_state`. Storing locks the replica rows (in id order, so two
writers never deadlock) and drops a sample older than the stored state, so a late writer never
counts an increase twice. A value lower than before is a counter reset (the replica restarted):
the delta is the new value itself. A replica's first scrape only sets the baseline, unless the
replica started (or became ready) within the last minute, when its raw values are the delta.

A Kubernetes replica is scraped pod by pod, never through its Service (which reaches one pod at
random, so two scrapes could read two pods and take the difference for an increase). Rows of a
Kubernetes version are slots, not pods: the version's ready pods are dealt over its ready rows
(one each when the counts match, as they do between scalings), every pod counted on exactly one
row, with its own previous sample; a row with two pods sums their deltas and combines their
gauges. A pod dealt to another row than last time continues from its newest sample on any row of
the version, so moves neither lose nor repeat an increase.

GPU series (dcgm-exporter's names) come from the replica's own page, else from the target's
`GpuSource`: NVML on this node for a local replica holding GPUs, the node's dcgm-exporter for a
Kubernetes pod (deployments/replicas/gpu_metrics.py). A scrape without them leaves the minute's
GPU columns as they were, so a replica without telemetry never reads as an idle GPU.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx
from django.db import transaction
from django.utils import timezone

from deployments.choices import DriverName, ReplicaState
from deployments.models import Replica, ReplicaMetricsMinute, ReplicaStart
from deployments.replicas.drivers import DriverError, driver_for
from deployments.replicas.gpu_metrics import (
    GPU_FAMILIES,
    GpuParseError,
    GpuSource,
    GpuStats,
    combine_gpu,
    gpu_stats,
    nvml_text,
    parse_gpu_text,
    samples_by_name,
)
from inferops.locks import LockId, try_advisory_lock

logger = logging.getLogger(__name__)

# Minute-row field prefix -> Prometheus family (as the parser names it: counters lose `_total`).
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
# A fraction per engine: several label sets (data-parallel engines) are averaged, not summed.
MEAN_GAUGES = {"kv_cache_usage"}
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "preemptions": "vllm:num_preemptions",
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
}
REQUESTS_FAMILY = "vllm:request_success"
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
# vLLM exposes it; a changed value proves a restart even when counters grew past the old ones.
PROCESS_START_FAMILY = "process_start_time_seconds"
# The built-in engine's cold-start moments (Unix seconds, 0 until they happen): with the process's
# start, they fill the phases of the replica's latest ReplicaStart (deployments/replicas/cold_start.py).
WEIGHTS_LOADED_FAMILY = "inferops:weights_loaded_time_seconds"
FIRST_TOKEN_FAMILY = "inferops:first_token_time_seconds"
# The built-in engine's SLO scheduling (docs/serving.md): counters into the row's `slo_scheduling`
# map, which stays empty for a replica without them (vLLM), so "no data" never reads as "no misses".
SLO_COUNTERS = {
    "judged": "inferops:slo_requests_judged",
    "rejected_late": "inferops:slo_rejected_late",
    "served_late": "inferops:slo_served_late",
}
SLO_MISSES_FAMILY = "inferops:slo_deadline_misses"  # by phase: missed_ttft, missed_tpot
SLO_SLACK_FAMILY = "inferops:slo_admission_slack_seconds"  # +Inf bucket: admitted; le=0: admitted late
SLO_POLICY_FAMILY = "inferops:scheduling_policy_info"
SLO_TARGET_FAMILIES = {"ttft_target_s": "inferops:slo_target_ttft_seconds",
                       "tpot_target_s": "inferops:slo_target_tpot_seconds"}

_WANTED_FAMILIES = (*GAUGES.values(), *COUNTERS.values(), REQUESTS_FAMILY, *HISTOGRAMS.values(),
                    PROCESS_START_FAMILY, WEIGHTS_LOADED_FAMILY, FIRST_TOKEN_FAMILY, *SLO_COUNTERS.values(),
                    SLO_MISSES_FAMILY, SLO_SLACK_FAMILY, SLO_POLICY_FAMILY, *SLO_TARGET_FAMILIES.values(),
                    *GPU_FAMILIES.values())
# A vLLM /metrics page is ~650 lines of which ~120 matter; parsing only those is ~8x faster,
# which is what lets one worker scrape hundreds of replicas well inside the interval.
_WANTED_LINE = re.compile(
    r"^(?:# (?:HELP|TYPE) )?(?:" + "|".join(re.escape(name) for name in _WANTED_FAMILIES)
    + r")(?:_total|_bucket|_sum|_count)?[ {]",
    re.MULTILINE,
)

SCRAPE_ERROR_PREFIX = "scrape: "
# A replica first seen this soon after it started has counted everything since zero.
FRESH_REPLICA_WINDOW = timedelta(seconds=60)
# A delta over a longer gap (scraper stopped, replica unreachable) would land in one minute as a
# spike; such a sample only re-baselines.
MAX_DELTA_SPAN = timedelta(minutes=5)
STORE_BATCH = 100


class MetricsParseError(ValueError):
    pass


@dataclass
class HistogramValues:
    buckets: dict[str, float]  # le (as Prometheus writes it, "+Inf" included) -> cumulative count
    sum: float = 0.0
    count: float = 0.0

    def as_json(self) -> dict:
        return {"buckets": self.buckets, "sum": self.sum, "count": self.count}

    @classmethod
    def from_json(cls, data: dict) -> HistogramValues:
        return cls(buckets=dict(data.get("buckets", {})), sum=data.get("sum", 0.0),
                   count=data.get("count", 0.0))


@dataclass
class MetricsSample:
    """One scrape's raw values, summed over label sets except `finished_reason`."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    requests_by_reason: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, HistogramValues] = field(default_factory=dict)
    process_start: float | None = None
    weights_loaded: float | None = None  # Unix seconds; None until loaded, or where not exported (vLLM)
    first_token: float | None = None  # likewise, until the process's first output
    slo: dict[str, float] = field(default_factory=dict)  # SLO scheduling counters (built-in engine)
    slo_info: dict = field(default_factory=dict)  # its policy and replica-wide targets, as last seen
    gpu: GpuStats | None = None  # its GPUs, from its own page or its target's GpuSource
    gpu_note: str = ""  # why the GPU figures are missing or partial (a source's error, no pod mapping)


def parse_metrics(text: str) -> MetricsSample:
    """Parse Prometheus text exposition into a MetricsSample; raises MetricsParseError."""
    try:
        by_name = samples_by_name(text, _WANTED_LINE)
    except ValueError as error:
        raise MetricsParseError(f"unparsable metrics text: {error}") from None
    if not any(name.startswith("vllm:") for name in by_name):
        raise MetricsParseError("no vllm: metrics in the response (is this a replica?)")
    parsed = MetricsSample()
    for key, name in GAUGES.items():
        values = [s.value for s in by_name.get(name, [])]
        if values:
            parsed.gauges[key] = sum(values) / len(values) if key in MEAN_GAUGES else sum(values)
    for key, name in COUNTERS.items():
        if f"{name}_total" in by_name:
            parsed.counters[key] = sum(s.value for s in by_name[f"{name}_total"])
    for s in by_name.get(f"{REQUESTS_FAMILY}_total", []):
        reason = s.labels.get("finished_reason", "")
        parsed.requests_by_reason[reason] = parsed.requests_by_reason.get(reason, 0.0) + s.value
    for key, name in HISTOGRAMS.items():
        if f"{name}_bucket" in by_name:
            parsed.histograms[key] = _histogram(by_name, name)
    starts = [s.value for s in by_name.get(PROCESS_START_FAMILY, [])]
    parsed.process_start = min(starts) if starts else None
    parsed.weights_loaded = _moment(by_name, WEIGHTS_LOADED_FAMILY)
    parsed.first_token = _moment(by_name, FIRST_TOKEN_FAMILY)
    _parse_slo_scheduling(by_name, parsed)
    parsed.gpu, _ = gpu_stats(by_name)
    return parsed


def _moment(by_name: dict[str, list], name: str) -> float | None:
    """The earliest moment a gauge of Unix seconds reports (0: not yet), or None."""
    moments = [s.value for s in by_name.get(name, []) if s.value > 0]
    return min(moments) if moments else None


def _parse_slo_scheduling(by_name: dict[str, list], parsed: MetricsSample) -> None:
    for key, name in SLO_COUNTERS.items():
        if f"{name}_total" in by_name:
            parsed.slo[key] = sum(s.value for s in by_name[f"{name}_total"])
    for s in by_name.get(f"{SLO_MISSES_FAMILY}_total", []):
        key = f"missed_{s.labels.get('phase', '')}"
        parsed.slo[key] = parsed.slo.get(key, 0.0) + s.value
    for s in by_name.get(f"{SLO_SLACK_FAMILY}_bucket", []):
        key = {"+Inf": "admitted", "0": "admitted_late", "0.0": "admitted_late"}.get(s.labels.get("le", ""))
        if key:
            parsed.slo[key] = parsed.slo.get(key, 0.0) + s.value
    policies = sorted({s.labels.get("policy", "") for s in by_name.get(SLO_POLICY_FAMILY, [])})
    if policies:
        parsed.slo_info["policy"] = ",".join(policies)
    for key, name in SLO_TARGET_FAMILIES.items():
        values = [s.value for s in by_name.get(name, [])]
        if values:
            parsed.slo_info[key] = max(values)


def _histogram(by_name: dict[str, list], name: str) -> HistogramValues:
    values = HistogramValues(buckets={})
    for s in by_name[f"{name}_bucket"]:
        le = s.labels["le"]
        values.buckets[le] = values.buckets.get(le, 0.0) + s.value
    values.sum = sum(s.value for s in by_name.get(f"{name}_sum", []))
    values.count = sum(s.value for s in by_name.get(f"{name}_count", []))
    return values


# --- deltas ---------------------------------------------------------------------------------


def counter_delta(previous: float | None, current: float) -> float:
    """Increase since the previous scrape. A series new since then counted from zero; a value
    lower than before means the replica restarted, so everything it shows is new."""
    if previous is None or current < previous:
        return current
    return current - previous


def histogram_delta(previous: HistogramValues | None, current: HistogramValues) -> HistogramValues:
    """Bucket-wise increase; a lower count, a lower bucket or a changed bucket layout is a reset."""
    if previous is None or _histogram_reset(previous, current):
        return HistogramValues(dict(current.buckets), current.sum, current.count)
    return HistogramValues(
        buckets={le: value - previous.buckets[le] for le, value in current.buckets.items()},
        sum=max(current.sum - previous.sum, 0.0),
        count=current.count - previous.count,
    )


def _histogram_reset(previous: HistogramValues, current: HistogramValues) -> bool:
    if current.count < previous.count or previous.buckets.keys() != current.buckets.keys():
        return True
    return any(value < previous.buckets[le] for le, value in current.buckets.items())


@dataclass
class SampleDeltas:
    counters: dict[str, float]
    requests_by_reason: dict[str, float]
    histograms: dict[str, HistogramValues]
    slo: dict[str, float] = field(default_factory=dict)


def sample_deltas(previous: MetricsSample | None, current: MetricsSample) -> SampleDeltas:
    """Deltas of `current` over `previous`; with no previous sample the raw values are deltas."""
    if previous is not None and _restarted(previous, current):
        previous = None
    old = previous or MetricsSample()
    return SampleDeltas(
        counters={key: counter_delta(old.counters.get(key), value)
                  for key, value in current.counters.items()},
        requests_by_reason={reason: counter_delta(old.requests_by_reason.get(reason), value)
                            for reason, value in current.requests_by_reason.items()},
        histograms={key: histogram_delta(old.histograms.get(key), value)
                    for key, value in current.histograms.items()},
        slo={key: counter_delta(old.slo.get(key), value) for key, value in current.slo.items()},
    )


def _restarted(previous: MetricsSample, current: MetricsSample) -> bool:
    return (previous.process_start is not None and current.process_start is not None
            and previous.process_start != current.process_start)


# --- scrape state kept on the replica row ---------------------------------------------------


def state_to_json(sample: MetricsSample, scraped_at: datetime) -> dict:
    return {
        "scraped_at": scraped_at.isoformat(),
        "counters": sample.counters,
        "requests_by_reason": sample.requests_by_reason,
        "histograms": {key: value.as_json() for key, value in sample.histograms.items()},
        "process_start": sample.process_start,
        **({"slo": sample.slo, "slo_info": sample.slo_info} if sample.slo or sample.slo_info else {}),
        **({"gpu_note": sample.gpu_note} if sample.gpu_note else {}),
    }


def state_from_json(state: dict) -> tuple[MetricsSample | None, datetime | None]:
    if not state or "scraped_at" not in state:
        return None, None
    sample = MetricsSample(
        counters=dict(state.get("counters", {})),
        requests_by_reason=dict(state.get("requests_by_reason", {})),
        histograms={key: HistogramValues.from_json(value)
                    for key, value in state.get("histograms", {}).items()},
        process_start=state.get("process_start"),
        slo=dict(state.get("slo", {})),
        slo_info=dict(state.get("slo_info", {})),
    )
    return sample, datetime.fromisoformat(state["scraped_at"])


def targets_from_json(state: dict) -> dict[str, dict]:
    """A replica's scrape state per target: "" for the replica itself, else a pod's URL."""
    if "pods" in state:
        return dict(state["pods"])
    return {"": state} if "scraped_at" in state else {}


def targets_to_json(states: dict[str, dict]) -> dict:
    # A replica scraped at its own URL keeps the flat shape it always had.
    if set(states) == {""}:
        return states[""]
    return {"pods": {key: value for key, value in states.items() if key}}


# --- fetching -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScrapeTarget:
    replica_id: int
    url: str  # the replica's base URL, or one of its pods'
    pod: str = ""  # the pod's URL when the target is one pod of a Kubernetes replica
    error: str = ""  # set when the targets could not even be listed: nothing to fetch
    gpu: GpuSource | None = None  # where its GPU series are when its own page lacks them


@dataclass
class ScrapeResult:
    replica_id: int
    scraped_at: datetime
    sample: MetricsSample | None = None
    error: str = ""
    pod: str = ""


def metrics_url(base_url: str) -> str:
    """`/metrics` sits at the server root, beside (not under) the OpenAI `/v1` prefix."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return f"{base}/metrics"


class MetricsFetcher:
    """Fetches and parses many replicas' /metrics at once, at most `concurrency` in flight.

    Each replica has its own deadline (`connect_timeout` to connect, `total_timeout` for the
    whole response) counted from when its turn comes, not from the start of the cycle.
    """

    def __init__(self, *, concurrency: int = 32, connect_timeout: float = 2.0,
                 total_timeout: float = 5.0, max_bytes: int = 8 * 1024 * 1024) -> None:
        self.concurrency = concurrency
        self.connect_timeout = connect_timeout
        self.total_timeout = total_timeout
        self.max_bytes = max_bytes

    def fetch_all(self, targets: Iterable[ScrapeTarget]) -> list[ScrapeResult]:
        return asyncio.run(self._fetch_all(list(targets)))

    async def _fetch_all(self, targets: list[ScrapeTarget]) -> list[ScrapeResult]:
        semaphore = asyncio.Semaphore(self.concurrency)
        # A node's dcgm-exporter serves every replica pod on the node: fetched once a cycle.
        self._shared_pages: dict[str, asyncio.Task] = {}
        timeout = httpx.Timeout(self.total_timeout, connect=self.connect_timeout)
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            try:
                return await asyncio.gather(
                    *(self._fetch_one(client, semaphore, target) for target in targets))
            finally:
                for task in self._shared_pages.values():  # one every reader gave up on
                    task.cancel()

    async def _fetch_one(self, client: httpx.AsyncClient, semaphore: asyncio.Semaphore,
                         target: ScrapeTarget) -> ScrapeResult:
        if target.error:
            return ScrapeResult(target.replica_id, timezone.now(), error=target.error)
        async with semaphore:
            # Stamped when the request leaves: of two overlapping scrapes of one replica, the one
            # sent first is answered first, and storing keeps only the newer (see _fold_samples).
            scraped_at = timezone.now()
            try:
                async with asyncio.timeout(self.total_timeout):
                    text = await self._get_text(client, metrics_url(target.url))
                sample = parse_metrics(text)
                if sample.gpu is None and target.gpu is not None:
                    await self._add_gpu(client, target.gpu, sample)
                return ScrapeResult(target.replica_id, scraped_at, sample=sample, pod=target.pod)
            except TimeoutError:
                error = f"no complete response within {self.total_timeout:g} s"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            except (MetricsParseError, UnicodeDecodeError) as exc:
                error = str(exc)
            if target.pod:
                error = f"pod {target.pod}: {error}"
            return ScrapeResult(target.replica_id, scraped_at, error=error, pod=target.pod)

    async def _add_gpu(self, client: httpx.AsyncClient, source: GpuSource, sample: MetricsSample) -> None:
        """Fill the sample's GPUs from the source; a failure is a note, never a failed scrape."""
        where = f"dcgm-exporter {source.url}" if source.url else f"NVML (devices {','.join(source.devices)})"
        try:
            async with asyncio.timeout(self.total_timeout):
                if source.devices:
                    text = await asyncio.to_thread(nvml_text, list(source.devices), source.hostname)
                elif source.url:
                    text = await self._shared_text(client, metrics_url(source.url))
                else:
                    sample.gpu_note = source.error
                    return
            sample.gpu, sample.gpu_note = parse_gpu_text(text, pod=source.pod, namespace=source.namespace)
            if sample.gpu is None and not sample.gpu_note:
                sample.gpu_note = f"{where} reported no GPU series" + (f" for pod {source.pod}" if source.pod else "")
        except TimeoutError:
            sample.gpu_note = f"{where}: no complete response within {self.total_timeout:g} s"
        except (httpx.HTTPError, GpuParseError, MetricsParseError, UnicodeDecodeError) as exc:
            sample.gpu_note = f"{where}: {exc or type(exc).__name__}"

    async def _shared_text(self, client: httpx.AsyncClient, url: str) -> str:
        if url not in self._shared_pages:
            self._shared_pages[url] = asyncio.ensure_future(self._get_text(client, url))
        # Shielded: one reader's deadline must not cancel the fetch the others wait on.
        return await asyncio.shield(self._shared_pages[url])

    async def _get_text(self, client: httpx.AsyncClient, url: str) -> str:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {response.status_code} from {url}",
                                            request=response.request, response=response)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise MetricsParseError(f"response from {url} exceeds {self.max_bytes} bytes")
            return body.decode("utf-8")


# --- storing --------------------------------------------------------------------------------


@dataclass
class StoreReport:
    stored: int = 0  # samples written into minute rows
    baselines: int = 0  # of which first or re-baselining samples (no counter deltas)
    stale: int = 0  # samples older than what another scraper already stored
    failed: int = 0  # failed scrapes recorded in last_error


MinuteKey = tuple[int, datetime]  # (replica id, minute start)


def minute_start(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


class MinuteAccumulator:
    """Folds one scrape (gauges + deltas) into a replica's minute row, in memory."""

    def __init__(self, row: ReplicaMetricsMinute) -> None:
        self.row = row

    def add_gauges(self, gauges: dict[str, float]) -> None:
        row = self.row
        for key in GAUGES:
            value = gauges.get(key, 0.0)
            average = getattr(row, f"{key}_avg")
            # Running mean over this minute's scrapes, so the row never needs the raw points.
            setattr(row, f"{key}_avg", average + (value - average) / (row.scrapes + 1))
            maximum = getattr(row, f"{key}_max")
            setattr(row, f"{key}_max", value if row.scrapes == 0 else max(maximum, value))
        row.scrapes += 1

    def add_gpu(self, gpu: GpuStats | None) -> None:
        """Running means over the minute's scrapes that carried GPU series (a scrape without
        them changes nothing: no telemetry is not an idle GPU)."""
        if gpu is None:
            return
        row = self.row
        n = row.gpu_scrapes
        for column, value in (("gpu_util_avg", gpu.util_percent), ("gpu_memory_used_avg", gpu.memory_used_mib),
                              ("gpu_power_avg", gpu.power_watts), ("gpu_sm_clock_avg", gpu.sm_clock_mhz)):
            average = getattr(row, column)
            setattr(row, column, average + (value - average) / (n + 1))
        row.gpu_util_max = gpu.util_percent if n == 0 else max(row.gpu_util_max, gpu.util_percent)
        row.gpu_temp_max = gpu.temp_max_c if n == 0 else max(row.gpu_temp_max, gpu.temp_max_c)
        row.gpu_memory_total = gpu.memory_total_mib if n == 0 else max(row.gpu_memory_total, gpu.memory_total_mib)
        row.gpu_devices = gpu.devices if n == 0 else max(row.gpu_devices, gpu.devices)
        row.gpu_scrapes = n + 1
        row.gpu_minutes = 1

    def add_deltas(self, deltas: SampleDeltas) -> None:
        row = self.row
        for key, value in deltas.counters.items():
            setattr(row, key, getattr(row, key) + round(value))
        row.requests_by_reason = add_counts(row.requests_by_reason, deltas.requests_by_reason)
        if deltas.slo:
            row.slo_scheduling = add_counts(row.slo_scheduling, {k: round(v) for k, v in deltas.slo.items()})
        for key, hist in deltas.histograms.items():
            setattr(row, f"{key}_buckets", add_counts(getattr(row, f"{key}_buckets"), hist.buckets))
            setattr(row, f"{key}_sum", getattr(row, f"{key}_sum") + hist.sum)
            setattr(row, f"{key}_count", getattr(row, f"{key}_count") + round(hist.count))


def add_counts(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Key-wise sum of two {label: count} maps (a new dict; counts stay integers when whole)."""
    merged = dict(total)
    for key, value in more.items():
        summed = merged.get(key, 0) + value
        merged[key] = int(summed) if float(summed).is_integer() else summed
    return merged


_MINUTE_FIELDS = [f.name for f in ReplicaMetricsMinute._meta.concrete_fields
                  if f.name not in {"id", "replica", "start"}]


def store_results(results: list[ScrapeResult]) -> StoreReport:
    """Write a cycle's results: minute rows for samples, last_error for failures."""
    report = StoreReport()
    # A replica's pods are folded together, so its results never straddle two batches.
    by_replica: dict[int, list[ScrapeResult]] = defaultdict(list)
    for result in results:
        by_replica[result.replica_id].append(result)
    ordered = sorted(by_replica.items())
    for begin in range(0, len(ordered), STORE_BATCH):
        _store_batch(dict(ordered[begin:begin + STORE_BATCH]), report)
    return report


def _store_batch(groups: dict[int, list[ScrapeResult]], report: StoreReport) -> None:
    with transaction.atomic():
        # Locking in id order serialises writers per replica without deadlocks; `of` keeps the
        # lock off the deployment rows that Replica's default ordering would join.
        replicas = {
            replica.pk: replica
            for replica in Replica.objects.select_for_update(of=("self",))
            .filter(pk__in=list(groups)).order_by("pk")
            .only("pk", "deployment_id", "version_id", "started_at", "ready_at", "last_error",
                  "scrape_state")
        }
        # One minute row per replica and cycle: its pods' answers may straddle a minute edge.
        minutes = {replica_id: minute_start(min(r.scraped_at for r in group if r.sample))
                   for replica_id, group in groups.items()
                   if any(r.sample is not None for r in group)}
        rows = _minute_rows(set(minutes.items()))
        pod_states = _version_pod_states(replicas.values(), groups)
        touched: dict[MinuteKey, ReplicaMetricsMinute] = {}
        changed: list[Replica] = []
        for replica_id, group in groups.items():
            replica = replicas.get(replica_id)
            if replica is None:  # deleted since the fetch
                continue
            failures = [result.error for result in group if result.sample is None]
            report.failed += len(failures)
            samples = [result for result in group if result.sample is not None]
            if samples:
                key = (replica.pk, minutes[replica.pk])
                row = rows.get(key) or ReplicaMetricsMinute(
                    replica_id=replica.pk, deployment_id=replica.deployment_id,
                    version_id=replica.version_id, start=key[1])
                if not _fold_samples(replica, row, samples, pod_states, report):
                    continue
                rows[key] = touched[key] = row
            if failures:
                replica.last_error = SCRAPE_ERROR_PREFIX + "; ".join(failures)
            elif replica.last_error.startswith(SCRAPE_ERROR_PREFIX):
                replica.last_error = ""
            changed.append(replica)
        if touched:
            # One INSERT .. ON CONFLICT for new and existing rows alike: the unique
            # (replica, start) pair picks the row, the replica lock makes the values current.
            for row in touched.values():
                row.pk = None
            ReplicaMetricsMinute.objects.bulk_create(
                list(touched.values()), update_conflicts=True,
                unique_fields=["replica", "start"], update_fields=_MINUTE_FIELDS)
        if changed:
            Replica.objects.bulk_update(changed, ["scrape_state", "last_error"])
        fill_cold_starts({replica_id: [r.sample for r in group if r.sample is not None]
                          for replica_id, group in groups.items() if replica_id in replicas})


def _minute_rows(keys: set[MinuteKey]) -> dict[MinuteKey, ReplicaMetricsMinute]:
    if not keys:
        return {}
    existing = ReplicaMetricsMinute.objects.filter(
        replica_id__in={replica_id for replica_id, _ in keys},
        start__in={start for _, start in keys})
    return {(row.replica_id, row.start): row for row in existing
            if (row.replica_id, row.start) in keys}


PodKey = tuple[int, int, str]  # (deployment id, version id, pod URL)


def _version_pod_states(replicas: Iterable[Replica],
                        groups: dict[int, list[ScrapeResult]]) -> dict[PodKey, dict]:
    """The newest stored state of every pod of the versions scraped pod by pod, whichever of the
    version's rows holds it: a pod dealt to another row (pods or rows came or went) continues
    its deltas there instead of re-baselining, or counting twice when it comes back."""
    versions = {(r.deployment_id, r.version_id) for r in replicas
                if any(result.pod for result in groups[r.pk])}
    if not versions:
        return {}
    newest: dict[PodKey, dict] = {}
    rows = Replica.objects.filter(version_id__in={version for _, version in versions}) \
        .values_list("deployment_id", "version_id", "scrape_state")
    for deployment_id, version_id, state in rows:
        if (deployment_id, version_id) not in versions:
            continue
        for pod, pod_state in targets_from_json(state or {}).items():
            key = (deployment_id, version_id, pod)
            if pod and (key not in newest or _at(pod_state) > _at(newest[key])):
                newest[key] = pod_state
    return newest


def _at(state: dict) -> datetime:
    return datetime.fromisoformat(state["scraped_at"])


def combine_gauges(per_target: list[dict[str, float]]) -> dict[str, float]:
    """One replica's gauges from its pods': counts add up, fractions average."""
    combined: dict[str, float] = {}
    for key in GAUGES:
        values = [gauges[key] for gauges in per_target if key in gauges]
        if values:
            combined[key] = sum(values) / len(values) if key in MEAN_GAUGES else sum(values)
    return combined


def _fold_samples(replica: Replica, row: ReplicaMetricsMinute, results: list[ScrapeResult],
                  pod_states: dict[PodKey, dict], report: StoreReport) -> bool:
    """Add one cycle's samples of a replica (one, or one per pod) to its minute row and advance
    the replica's scrape state. Returns False when every sample was stale (another scraper
    already stored a newer one)."""
    states = targets_from_json(replica.scrape_state or {})
    if any(result.pod for result in results):
        # Pods only: a state from when the replica was scraped through its Service is no pod's.
        states = {pod: state for pod, state in states.items() if pod}
    accumulator = MinuteAccumulator(row)
    gauges, gpus = [], []
    for result in results:
        stored = states.get(result.pod)
        if result.pod:
            newest = pod_states.get((replica.deployment_id, replica.version_id, result.pod))
            if newest and (stored is None or _at(newest) > _at(stored)):
                stored = newest
        previous, previous_at = state_from_json(stored or {})
        if previous_at is not None and (result.scraped_at <= previous_at
                                        or _went_backwards(previous, result.sample)):
            report.stale += 1
            continue
        if previous is not None and result.scraped_at - previous_at <= MAX_DELTA_SPAN:
            accumulator.add_deltas(sample_deltas(previous, result.sample))
        elif previous is None and _fresh(replica, result):
            accumulator.add_deltas(sample_deltas(None, result.sample))
        else:
            report.baselines += 1
        gauges.append(result.sample.gauges)
        if result.sample.gpu is not None:
            gpus.append(result.sample.gpu)
        states[result.pod] = state_to_json(result.sample, result.scraped_at)
        report.stored += 1
    if not gauges:
        return False
    accumulator.add_gauges(combine_gauges(gauges))
    accumulator.add_gpu(combine_gpu(gpus))
    # A pod gone for longer than a delta may span will only ever re-baseline: forget it.
    horizon = max(result.scraped_at for result in results) - MAX_DELTA_SPAN
    replica.scrape_state = targets_to_json(
        {pod: state for pod, state in states.items() if _at(state) >= horizon})
    return True


def _went_backwards(previous: MetricsSample, current: MetricsSample) -> bool:
    """Lower counters from the same process (known by its start time) mean an older answer that
    arrived late, not a reset."""
    if previous.process_start is None or previous.process_start != current.process_start:
        return False
    return any(value < previous.counters.get(key, 0.0) for key, value in current.counters.items())


def _fresh(replica: Replica, result: ScrapeResult) -> bool:
    """Started (or became ready) within the last minute: its counters began at zero recently
    enough that everything they show belongs to this minute. A pod that joined a running
    version says when its process started."""
    moments = [moment for moment in (replica.started_at, replica.ready_at) if moment is not None]
    if result.pod and result.sample.process_start is not None:
        moments = [datetime.fromtimestamp(result.sample.process_start, tz=result.scraped_at.tzinfo)]
    return bool(moments) and result.scraped_at - max(moments) <= FRESH_REPLICA_WINDOW


# --- cold starts ----------------------------------------------------------------------------

# A process that started this long before its start was asked for is another one (an older process,
# or a pod this start did not make); the slack covers the clocks of other nodes.
START_CLOCK_SLACK = timedelta(seconds=5)
_PHASE_FIELDS = ("process_started_at", "weights_loaded_at", "first_token_at")


def start_phases(start: ReplicaStart, sample: MetricsSample) -> list[str]:
    """Set the phases of `start` that its replica's /metrics `sample` tells and the row still lacks;
    returns the fields set. A sample of another process than this start's sets nothing."""
    if start.failed:
        return []
    began = sample.process_start if sample.process_start is not None else sample.weights_loaded
    if began is None or began < (start.started_at - START_CLOCK_SLACK).timestamp():
        return []
    changed = []
    for name, moment in zip(_PHASE_FIELDS, (sample.process_start, sample.weights_loaded, sample.first_token),
                            strict=True):
        if moment is not None and getattr(start, name) is None:
            setattr(start, name, datetime.fromtimestamp(moment, tz=UTC))
            changed.append(name)
    return changed


def fill_cold_starts(samples: dict[int, list[MetricsSample]]) -> int:
    """Fill each replica's latest start from its samples (a replica's own, or one per pod); returns
    how many starts changed. One query reads the starts, one writes those that changed."""
    replica_ids = [replica_id for replica_id, found in samples.items() if found]
    if not replica_ids:
        return 0
    latest = (ReplicaStart.objects.filter(replica_id__in=replica_ids)
              .order_by("replica_id", "-started_at", "-id").distinct("replica_id"))
    changed: list[ReplicaStart] = []
    fields: set[str] = set()
    for start in latest:
        if start.failed or all(getattr(start, name) is not None for name in _PHASE_FIELDS):
            continue
        for sample in samples[start.replica_id]:
            if done := start_phases(start, sample):
                changed.append(start)
                fields.update(done)
                break
    if changed:
        ReplicaStart.objects.bulk_update(changed, sorted(fields))
    return len(changed)


# --- one cycle ------------------------------------------------------------------------------


@dataclass
class CycleReport:
    replicas: int = 0
    fetch_s: float = 0.0
    store_s: float = 0.0
    store: StoreReport = field(default_factory=StoreReport)
    skipped: bool = False  # another cycle was still running
    targets: int = 0  # replicas scraped at their own URL, plus one per pod of a Kubernetes one

    def as_dict(self) -> dict:
        return {"replicas": self.replicas, "targets": self.targets, "fetch_s": round(self.fetch_s, 3),
                "store_s": round(self.store_s, 3), "skipped": self.skipped, **self.store.__dict__}




def exclusive_cycle():
    """Whether this process may scrape now (a context manager yielding a bool).

    Two cycles whose fetches overlap can have one replica answer them in the other order than
    they were sent, and an older answer stored last would look like a counter reset; a cycle
    that finds another one running therefore skips its turn instead of racing it.
    """
    return try_advisory_lock(LockId.SCRAPE)


# A version's ready pods: base URLs, or (base URL, where its GPU series are) pairs.
PodLister = Callable[[Replica], list[str] | list[tuple[str, GpuSource | None]]]


def ready_targets(*, pod_urls: PodLister | None = None) -> list[ScrapeTarget]:
    """Ready replicas, those whose last scrape failed first: their timeouts then run beside the
    healthy replicas' fetches instead of after them, and the cycle ends sooner.

    A Kubernetes version's ready pods are targets of their own, dealt over its ready rows;
    `pod_urls` lists them (the Kubernetes driver's `scrape_pods` by default, which also finds the
    dcgm-exporter on each pod's node), once a version. A local replica holding GPUs of this node
    gets them read through NVML when its own page has no GPU series (vLLM).
    """
    rows = (Replica.objects.filter(state=ReplicaState.READY).exclude(url="")
            .order_by("pk").values_list("pk", "url", "last_error", "driver", "version_id", "identity"))
    rows = sorted(rows, key=lambda row: not row[2].startswith(SCRAPE_ERROR_PREFIX))
    slots: dict[int, list[int]] = defaultdict(list)  # Kubernetes version id -> its ready rows
    for pk, _, _, driver, version_id, _ in rows:
        if driver == DriverName.KUBERNETES:
            slots[version_id].append(pk)
    pods = _pod_targets(slots, pod_urls)
    gpus = _local_gpu_sources([(pk, identity) for pk, _, _, driver, _, identity in rows
                               if driver == DriverName.LOCAL and (identity or {}).get("gpus")])
    targets: list[ScrapeTarget] = []
    for pk, url, _, driver, _, _ in rows:
        if driver != DriverName.KUBERNETES:
            targets.append(ScrapeTarget(pk, url, gpu=gpus.get(pk)))
        else:
            targets += pods.get(pk, [])
    return targets


def _local_gpu_sources(rows: list[tuple[int, dict]]) -> dict[int, GpuSource]:
    """NVML sources for local replicas holding GPUs of this worker's node (NVML sees no other)."""
    if not rows:
        return {}
    driver = driver_for(DriverName.LOCAL)
    sources = {}
    for pk, identity in rows:
        if devices := driver.held_gpus(pk, identity):
            sources[pk] = GpuSource(devices=tuple(devices), hostname=identity.get("node", ""))
    return sources


def _pod_targets(slots: dict[int, list[int]], pod_urls: PodLister | None) -> dict[int, list[ScrapeTarget]]:
    if not slots:
        return {}
    if pod_urls is None:
        pod_urls = driver_for(DriverName.KUBERNETES).scrape_pods
    listed_on = {min(row_ids): sorted(row_ids) for row_ids in slots.values()}
    targets: dict[int, list[ScrapeTarget]] = defaultdict(list)
    for replica in Replica.objects.filter(pk__in=listed_on).select_related("deployment", "version"):
        row_ids = listed_on[replica.pk]
        try:
            pods = sorted(((item, None) if isinstance(item, str) else item for item in pod_urls(replica)),
                          key=lambda pod: pod[0])
        except DriverError as exc:
            targets[replica.pk].append(ScrapeTarget(replica.pk, "", error=f"listing its pods: {exc}"))
            continue
        # Sorted pods over sorted rows: the same pods land on the same rows from cycle to cycle.
        for index, (url, gpu) in enumerate(pods):
            row_id = row_ids[index % len(row_ids)]
            targets[row_id].append(ScrapeTarget(row_id, url, pod=url, gpu=gpu))
    return targets


def scrape_cycle(*, fetcher: MetricsFetcher | None = None,
                 targets: list[ScrapeTarget] | None = None) -> CycleReport:
    """Scrape every ready replica once and store the results (skipped while another runs)."""
    with exclusive_cycle() as acquired:
        if not acquired:
            return CycleReport(skipped=True)
        targets = ready_targets() if targets is None else targets
        began = time.perf_counter()
        results = (fetcher or MetricsFetcher()).fetch_all(targets)
        fetched = time.perf_counter()
        store = store_results(results)
    replicas = len({target.replica_id for target in targets})
    report = CycleReport(replicas, fetched - began, time.perf_counter() - fetched, store,
                         targets=len(targets))
    if store.failed:
        logger.info("scrape cycle: %d of %d targets failed", store.failed, len(targets))
    return report
