"""Time series of a deployment's replica metrics, for the API and the console charts.

`deployment_series(deployment, series, start, end, step_s)` returns `[[iso_time, value], ...]`,
one point per step beginning at `start`; a step with no data has the value `None` (null in
JSON), so charts show a gap rather than a false zero. Units:

- `*_per_s` series: events per second (sum of the deltas in the step / step seconds);
  `requests_per_s` counts finished requests of every finish reason (stop, length, abort, error);
- latency percentiles (`ttft_p50`, `itl_p95`, `e2e_p99`, ...): milliseconds, estimated from the
  replicas' summed histogram bucket deltas over the step (see `histogram_quantile`);
- `kv_cache_usage`: fraction 0..1, the mean over replicas (per period, then over the step);
- `queue_depth` / `running`: requests, the sum over replicas of their average (per period,
  then averaged over the step).
- `gpu_utilization`: fraction 0..1, the mean over the replicas' GPUs (per period, then over the
  step); `gpu_memory_used` / `gpu_memory_total`: MiB, summed over the replicas' GPUs. Only rows
  with GPU telemetry count: a step where no replica reported GPU series is None, never 0.
- `mfu`: model FLOPs utilisation, fraction 0..1 (see `mfu_facts`): the step's FLOPs, 2 x
  parameters per prompt or generated token, over the peak FLOPs of the GPUs its replicas held
  (resources.gpu_count per replica, for every period a replica has a row); None where unknown.

Minute rows serve ranges that start inside the minute retention; older ranges use hour rows,
for which a step shorter than an hour leaves gaps. A rate's last step, cut short by `end` or by
now, is divided by the seconds it covers, so the step in progress does not read as a drop.

`deployment_error_rate` reads the usage ledger instead (every request, shed ones included), and
`deployment_events` lists what happened to the deployment, for markers on its charts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection
from django.utils import timezone

from alerts.models import Alert
from deployments.choices import ReplicaState
from deployments.gpus import known_type, parameters, peak_flops
from deployments.models import ReplicaMetricsHour, ReplicaMetricsMinute, Rollout
from deployments.replicas.retention import minute_retention
from deployments.replicas.scraping import targets_from_json
from deployments.rollouts.gate import gate
from deployments.rollouts.series import rollout_series
from inferops.models import AuditEvent
from registry.models import ModelVersion
from runtime.gateway.contract import PREVIEW_SUFFIX

MAX_POINTS = 5000


def histogram_quantile(q: float, buckets: Mapping[str | float, float]) -> float | None:
    """Estimate the q-quantile from cumulative buckets {le: count}, as Prometheus does.

    Finds the bucket where the rank q * total falls and interpolates linearly inside it (the
    first bucket starts at 0). A rank in the +Inf bucket returns the highest finite bound.
    Returns None without observations or without a +Inf bucket.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = sorted((float(le), float(count)) for le, count in buckets.items())
    if len(bounds) < 2 or not math.isinf(bounds[-1][0]):
        return None
    # Summed or rounded buckets can dip; a cumulative count never does (Prometheus fixes it too).
    cumulative, running = [], 0.0
    for upper, count in bounds:
        running = max(running, count)
        cumulative.append((upper, running))
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    index = next((i for i, (_, count) in enumerate(cumulative[:-1]) if count >= rank),
                 len(cumulative) - 1)
    if index == len(cumulative) - 1:
        return cumulative[-2][0]
    upper, count = cumulative[index]
    if index == 0 and upper <= 0:
        return upper
    lower, below = cumulative[index - 1] if index > 0 else (0.0, 0.0)
    if count == below:  # an empty bucket reached only by rank 0
        return lower
    return lower + (upper - lower) * (rank - below) / (count - below)


@dataclass(frozen=True)
class PercentileSeries:
    histogram: str  # ttft, itl or e2e
    quantile: float


@dataclass(frozen=True)
class RateSeries:
    counter: str  # a counter column, or "requests" for the sum over finish reasons


@dataclass(frozen=True)
class SloSeries:
    key: str  # a count of the rows' slo_scheduling map; None where no replica exported it


@dataclass(frozen=True)
class GaugeSeries:
    column: str  # a *_avg column
    across_replicas: str  # "sum" or "mean"


@dataclass(frozen=True)
class GpuSeries:
    column: str  # a gpu_* column
    across_replicas: str  # "sum", or "devices": the mean over every replica's devices
    scale: float = 1.0


@dataclass(frozen=True)
class MfuSeries:
    pass


SERIES: dict[str, PercentileSeries | RateSeries | GaugeSeries | SloSeries | GpuSeries | MfuSeries] = {
    "requests_per_s": RateSeries("requests"),
    "output_tokens_per_s": RateSeries("generation_tokens"),
    "prompt_tokens_per_s": RateSeries("prompt_tokens"),
    "preemptions_per_s": RateSeries("preemptions"),
    **{f"{name}_p{round(q * 100)}": PercentileSeries(name, q)
       for name in ("ttft", "itl", "e2e") for q in (0.5, 0.95, 0.99)},
    "kv_cache_usage": GaugeSeries("kv_cache_usage_avg", "mean"),
    "queue_depth": GaugeSeries("waiting_avg", "sum"),
    "running": GaugeSeries("running_avg", "sum"),
    "gpu_utilization": GpuSeries("gpu_util_avg", "devices", scale=0.01),
    "gpu_memory_used": GpuSeries("gpu_memory_used_avg", "sum"),
    "gpu_memory_total": GpuSeries("gpu_memory_total", "sum"),
    "mfu": MfuSeries(),
    **{f"slo_{key}_per_s": SloSeries(key)
       for key in ("judged", "missed_ttft", "missed_tpot", "rejected_late", "served_late")},
}


def rows_model(start: datetime, now: datetime | None = None):
    """Minute rows while `start` lies within their retention, else hour rows."""
    now = now or timezone.now()
    return ReplicaMetricsMinute if start >= now - minute_retention() else ReplicaMetricsHour


def deployment_series(deployment, series: str, start: datetime, end: datetime, step_s: int,
                      *, version=None, now: datetime | None = None) -> list[list]:
    """[[iso_time, value or None], ...] for `series` over the deployment's replicas.

    `version` (a ModelVersion, or a version number of the deployment's model) restricts to
    replicas of that version, for a canary beside its baseline. Raises ValueError naming the
    bad argument.
    """
    spec = SERIES.get(series)
    if spec is None:
        raise ValueError(f"series: unknown {series!r}; choose one of {', '.join(SERIES)}")
    if step_s <= 0:
        raise ValueError("step_s: must be a positive number of seconds")
    if end <= start:
        raise ValueError("end: must be after start")
    steps = math.ceil((end - start).total_seconds() / step_s)
    if steps > MAX_POINTS:
        raise ValueError(f"step_s: {steps} points requested, at most {MAX_POINTS}; "
                         "use a larger step")
    model = rows_model(start, now)
    facts = mfu_facts(deployment) if isinstance(spec, MfuSeries) else None
    if facts is not None and facts.reason:
        return [[(start + timedelta(seconds=index * step_s)).isoformat(), None] for index in range(steps)]
    rows = model.objects.filter(
        deployment=deployment, start__gte=start, start__lt=end)
    if isinstance(version, ModelVersion):
        rows = rows.filter(version=version)
    elif version is not None:
        # A deployment serves one model, so a number names one of its versions.
        rows = rows.filter(version__number=version)
    in_step: dict[int, list] = defaultdict(list)
    for row in rows.only(*_columns(spec)):
        in_step[int((row.start - start).total_seconds() // step_s)].append(row)
    cut = min(end, now or timezone.now())
    return [
        [(start + timedelta(seconds=index * step_s)).isoformat(),
         _value(spec, in_step[index], _covered_s(start, index, step_s, cut), mfu=facts,
                period_s=_period_s(model))
         if index in in_step else None]
        for index in range(steps)
    ]


def _period_s(model) -> float:
    return 60.0 if model is ReplicaMetricsMinute else 3600.0


def _covered_s(start: datetime, index: int, step_s: int, cut: datetime) -> float:
    """Seconds of step `index` before `cut` (the end of the range or now), at least one."""
    begins = start + timedelta(seconds=index * step_s)
    return max(1.0, min(float(step_s), (cut - begins).total_seconds()))


def _columns(spec) -> list[str]:
    if isinstance(spec, PercentileSeries):
        return ["start", f"{spec.histogram}_buckets"]
    if isinstance(spec, RateSeries):
        return ["start", "requests_by_reason" if spec.counter == "requests" else spec.counter]
    if isinstance(spec, SloSeries):
        return ["start", "slo_scheduling"]
    if isinstance(spec, GpuSeries):
        return ["start", "gpu_scrapes", "gpu_devices", spec.column]
    if isinstance(spec, MfuSeries):
        return ["start", "version_id", "prompt_tokens", "generation_tokens"]
    return ["start", spec.column]


def _value(spec, rows: list, step_s: float, *, mfu: MfuFacts | None = None, period_s: float = 60.0) -> float | None:
    if isinstance(spec, PercentileSeries):
        summed: dict[str, float] = defaultdict(float)
        for row in rows:
            for le, count in getattr(row, f"{spec.histogram}_buckets").items():
                summed[le] += count
        seconds = histogram_quantile(spec.quantile, summed)
        return None if seconds is None else seconds * 1000.0
    if isinstance(spec, SloSeries):
        counts = [row.slo_scheduling[spec.key] for row in rows if spec.key in row.slo_scheduling]
        return sum(counts) / step_s if counts else None
    if isinstance(spec, GpuSeries):
        return _gpu_value(spec, [row for row in rows if row.gpu_scrapes])
    if isinstance(spec, MfuSeries):
        flops, gpu_seconds, _ = mfu.totals(rows, period_s)
        return flops / (mfu.peak_flops * gpu_seconds) if gpu_seconds else None
    if isinstance(spec, RateSeries):
        if spec.counter == "requests":
            total = sum(sum(row.requests_by_reason.values()) for row in rows)
        else:
            total = sum(getattr(row, spec.counter) for row in rows)
        return total / step_s
    # One row per replica and period (a unique pair), so a period's rows are its replicas.
    by_period: dict[datetime, list[float]] = defaultdict(list)
    for row in rows:
        by_period[row.start].append(getattr(row, spec.column))
    combine = sum if spec.across_replicas == "sum" else (lambda values: sum(values) / len(values))
    per_period = [combine(values) for values in by_period.values()]
    return sum(per_period) / len(per_period)


def _gpu_value(spec: GpuSeries, rows: list) -> float | None:
    if not rows:  # no GPU telemetry in the step: unknown, not idle
        return None
    by_period: dict[datetime, list] = defaultdict(list)
    for row in rows:
        by_period[row.start].append(row)
    per_period = []
    for period in by_period.values():
        if spec.across_replicas == "sum":
            per_period.append(sum(getattr(row, spec.column) for row in period))
        else:
            devices = sum(row.gpu_devices for row in period)
            per_period.append(sum(getattr(row, spec.column) * row.gpu_devices for row in period) / devices)
    return sum(per_period) / len(per_period) * spec.scale


# ---------------------------------------------------------------------------- model FLOPs utilisation

FLOPS_PER_TOKEN_NOTE = ("FLOPs per token ≈ 2 × parameters: a dense transformer's forward pass, one multiply and "
                        "one add per weight for each prompt or generated token; attention over the context, the "
                        "work of speculative or preempted tokens and padding are left out")


@dataclass(frozen=True)
class MfuFacts:
    """What model FLOPs utilisation needs of a deployment, or why it cannot be estimated."""

    gpu_type: str = ""
    gpus_per_replica: int = 0
    peak_flops: float = 0.0  # per GPU, dense BF16
    parameters: dict = field(default_factory=dict)  # version id -> (parameter count, how it is known)
    reason: str = ""  # why no MFU is shown, or ""

    def flops_per_token(self, version_id: int) -> float:
        return 2.0 * self.parameters[version_id][0]

    def totals(self, rows: list, period_s: float) -> tuple[float, float, int]:
        """(FLOPs, GPU-seconds held, tokens) of metric rows: each row is one replica for one period."""
        tokens = flops = 0.0
        for row in rows:
            counted = row.prompt_tokens + row.generation_tokens
            tokens += counted
            flops += counted * self.flops_per_token(row.version_id)
        return flops, len(rows) * period_s * self.gpus_per_replica, int(tokens)


def mfu_facts(deployment) -> MfuFacts:
    resources = deployment.resources or {}
    gpus = int(resources.get("gpu_count") or 0)
    gpu_type = str(resources.get("gpu_type") or "")
    if gpus < 1:
        return MfuFacts(reason="the deployment holds no GPUs (resources.gpu_count is 0)")
    if not gpu_type:
        return MfuFacts(reason="resources.gpu_type is not set, so the GPUs' peak FLOPs are unknown")
    peak = peak_flops(gpu_type)
    if peak is None:
        why = "" if known_type(gpu_type) else " (not a type inferops knows)"
        return MfuFacts(reason=f"no peak FLOPs are known for GPU type {gpu_type!r}{why}: see deployments/gpus.py")
    counts = {}
    for version in ModelVersion.objects.filter(model_id=deployment.model_id).select_related("model"):
        count, how = parameters(version)
        if count is None:
            if version.pk == deployment.version_id:
                return MfuFacts(reason=f"the parameter count is unknown: {how}")
            continue
        counts[version.pk] = (count, how)
    return MfuFacts(gpu_type=gpu_type, gpus_per_replica=gpus, peak_flops=peak, parameters=counts)


def mfu_summary(deployment, start: datetime, end: datetime, *, now: datetime | None = None) -> dict:
    """Model FLOPs utilisation over [start, end), with every figure of its formula, or the reason it
    is not shown: {"mfu", "tokens_per_s", "flops_per_token", "parameters", "parameters_from",
    "peak_tflops", "gpus", "gpu_type", "seconds"} or {"reason"}."""
    facts = mfu_facts(deployment)
    if facts.reason:
        return {"reason": facts.reason}
    model = rows_model(start, now)
    rows = list(model.objects.filter(deployment=deployment, start__gte=start, start__lt=end)
                .only(*_columns(MfuSeries())))
    rows = [row for row in rows if row.version_id in facts.parameters]
    seconds = (min(end, now or timezone.now()) - start).total_seconds()
    if not rows or seconds <= 0:
        return {"reason": "no replica of the deployment was scraped in this window"}
    flops, gpu_seconds, tokens = facts.totals(rows, _period_s(model))
    counts = {facts.parameters[row.version_id] for row in rows}
    count, how = max(counts)  # the one shown; the FLOPs above count each version's own
    return {
        "mfu": flops / (facts.peak_flops * gpu_seconds),
        "tokens_per_s": tokens / seconds,
        "flops_per_token": flops / tokens if tokens else 2.0 * count,
        "parameters": count, "parameters_from": how, "versions": len(counts),
        "peak_tflops": facts.peak_flops / 1e12, "gpu_type": facts.gpu_type,
        "gpus": gpu_seconds / seconds, "seconds": seconds,
        "note": FLOPS_PER_TOKEN_NOTE,
    }


# ---------------------------------------------------------------------------- error rate


def error_rate_sql() -> str:
    # Every event of the deployment counts, with or without a replica: a request the gateway shed
    # (no replica ready, all saturated) or failed before choosing one is the deployment's failure.
    return f"""
    SELECT date_bin(make_interval(secs => %(step)s), e.time, %(start)s) AS bucket,
           count(*) AS requests,
           count(*) FILTER (WHERE {gate().server_failure_sql}) AS failed,
           count(*) FILTER (WHERE {gate().server_failure_sql} AND e.replica IS NULL) AS failed_unrouted
    FROM tenants_usageevent e
    WHERE e.deployment IN (%(deployment)s, %(preview)s) AND e.time >= %(start)s AND e.time < %(end)s
    GROUP BY 1
"""


def deployment_error_rate(deployment, start: datetime, end: datetime, step_s: int) -> dict:
    """Server failures / requests per step over every request of the deployment, from the usage ledger.

    Returns {"points": [[iso_time, rate or None]], "counts": [[iso_time, requests, failed,
    failed before a replica]], "tracks": {"stable": [[iso_time, rate or None]], "candidate": ...}}.
    A failure is what the SLOs call one (status >= 500 or a shed / upstream / internal error; a
    degradation policy's deliberate 503 is not). Tracks exist while a rollout runs: each step that
    a rollout spans gets the stable and candidate rates of rollout_series (by the replica that
    served or failed each attempt); a request failed before any replica belongs to no track and
    counts in the deployment's line only. Steps without a request are None.
    """
    steps = math.ceil((end - start).total_seconds() / step_s)
    if steps > MAX_POINTS:
        raise ValueError(f"step_s: {steps} points requested, at most {MAX_POINTS}; use a larger step")
    times = [(start + timedelta(seconds=i * step_s)) for i in range(steps)]
    counts = [[0, 0, 0] for _ in range(steps)]
    params = {"step": step_s, "start": start, "end": end, "deployment": deployment.name,
              "preview": deployment.name + PREVIEW_SUFFIX}
    with connection.cursor() as cursor:
        cursor.execute(error_rate_sql(), params)
        for bucket, requests, failed, unrouted in cursor.fetchall():
            index = round((bucket - start).total_seconds() / step_s)
            if 0 <= index < steps:
                counts[index] = [requests, failed, unrouted]
    tracks: dict[str, list] = {}
    for rollout in _rollouts_within(deployment, start, end):
        # Only the steps the rollout spans, on the same step boundaries as the deployment's line.
        first = max(0, int((rollout.created_at - start).total_seconds() // step_s))
        last = steps if rollout.finished_at is None else min(
            steps, int((rollout.finished_at - start).total_seconds() // step_s) + 1)
        if first >= last:
            continue
        series = rollout_series(rollout, times[first], min(end, times[last - 1] + timedelta(seconds=step_s)),
                                bucket_s=step_s)
        for track in ("stable", "candidate"):
            rates = tracks.setdefault(track, [None] * steps)
            for offset, rate in enumerate(series[track]["error_rate"][:last - first]):
                if rate is not None:
                    rates[first + offset] = rate
    return {
        "points": [[t.isoformat(), round(failed / requests, 4) if requests else None]
                   for t, (requests, failed, _) in zip(times, counts, strict=True)],
        "counts": [[t.isoformat(), *row] for t, row in zip(times, counts, strict=True)],
        "tracks": {track: [[t.isoformat(), rate] for t, rate in zip(times, rates, strict=True)]
                   for track, rates in tracks.items()},
    }


# At most this many rollouts are split into tracks on one chart (the newest ones).
MAX_ROLLOUTS = 20


def _rollouts_within(deployment, start: datetime, end: datetime) -> list:
    rollouts = (Rollout.objects.filter(deployment=deployment, created_at__lt=end)
                .exclude(finished_at__lt=start).order_by("-created_at")[:MAX_ROLLOUTS])
    return list(reversed(rollouts))


# ---------------------------------------------------------------------------- events

# Rollout timeline entries worth a marker on every chart (weights and analyses stay on the rollout page,
# except a failed analysis, which explains the abort beside it).
ROLLOUT_MARKERS = {"created", "promoted", "aborted", "succeeded", "retried", "rolled back", "analysis failed"}
MAX_EVENTS = 200


def deployment_events(deployment, start: datetime, end: datetime) -> list[dict]:
    """What happened to the deployment in [start, end), oldest first: [{"at", "kind", "text"}].

    Kinds: `deploy` (created, version or replica count changed: from the audit log), `scale` (the
    autoscaler's decisions, with their reasons, from the audit log too), `rollout`
    (started, promoted, aborted, succeeded, rolled back: from the rollouts' timelines), `restart`
    (a replica's latest restart with its last error) and `alert` (fired or resolved, for alerts
    labelled with the deployment).
    """
    def inside(at) -> bool:
        return at is not None and start <= at < end

    events = []
    audits = AuditEvent.objects.filter(object_type="deployments.deployment", object_id=str(deployment.pk),
                                       created_at__gte=start, created_at__lt=end).order_by("created_at")[:MAX_EVENTS]
    audits = list(audits)
    version_ids = {snap.get("version") for a in audits for snap in (a.before or {}, a.after or {})}
    numbers = dict(ModelVersion.objects.filter(pk__in=version_ids - {None}).values_list("pk", "number"))
    for audit in audits:
        if audit.action == "deployment.autoscale":  # the autoscaler's decision, with its reason
            after = audit.after or {}
            events.append({"at": audit.created_at, "kind": "scale", "text": (
                f"Autoscaler: replicas {(audit.before or {}).get('replicas')} → {after.get('replicas')} "
                f"({after.get('kind', 'scale')}): {after.get('reason', '')}")})
            continue
        text = _deploy_text(audit, numbers)
        if text:
            events.append({"at": audit.created_at, "kind": "deploy", "text": f"{text} by {audit.actor_name}"})
    for rollout in _rollouts_within(deployment, start, end):
        name = f"{'Rollback' if rollout.rollback else 'Rollout'} {rollout.pk}"
        for entry in rollout.timeline:
            at = datetime.fromisoformat(entry["at"])
            if entry["event"] in ROLLOUT_MARKERS and inside(at):
                detail = f": {entry['detail']}" if entry.get("detail") else ""
                verb = "started" if entry["event"] == "created" else entry["event"]
                events.append({"at": at, "kind": "rollout", "text": f"{name} {verb}{detail}"})
    restarted = (deployment.replica_set.filter(restarts__gt=0, started_at__gte=start, started_at__lt=end)
                 .order_by("-started_at")[:MAX_EVENTS])
    for replica in restarted:
        reason = replica.last_error.strip() or "no error recorded"
        events.append({"at": replica.started_at, "kind": "restart",
                       "text": f"Replica {replica.pk} restarted (restart {replica.restarts}): {reason[:300]}"})
    alerts = (Alert.objects.filter(labels__deployment=deployment.name, starts_at__lt=end)
              .exclude(ends_at__lt=start).order_by("-starts_at")[:MAX_EVENTS])
    for alert in alerts:
        title = alert.annotations.get("summary") or alert.labels.get("alertname") or f"alert {alert.pk}"
        if inside(alert.starts_at):
            events.append({"at": alert.starts_at, "kind": "alert", "text": f"Alert fired ({alert.severity}): {title}"})
        if inside(alert.ends_at):
            events.append({"at": alert.ends_at, "kind": "alert", "text": f"Alert resolved: {title}"})
    events.sort(key=lambda event: event["at"])
    return [{**event, "at": event["at"].isoformat()} for event in events[-MAX_EVENTS:]]


def _deploy_text(audit, numbers: dict) -> str:
    before, after = audit.before or {}, audit.after or {}
    if audit.action == "deployment.create":
        return f"Deployed v{numbers.get(after.get('version'), '?')} × {after.get('replicas', '?')}"
    if audit.action == "deployment.delete":
        return "Deleted"
    changes = []
    if before.get("version") != after.get("version"):
        old, new = (numbers.get(snap.get("version"), "?") for snap in (before, after))
        changes.append(f"version v{old} → v{new}")
    if before.get("replicas") != after.get("replicas"):
        changes.append(f"replicas {before.get('replicas')} → {after.get('replicas')}")
    if before.get("engine_args") != after.get("engine_args"):
        changes.append("engine arguments changed")
    return ("Changed " + ", ".join(changes)) if changes else ""


# ------------------------------------------------------------------- SLO scheduling summary


SLO_COUNT_KEYS = ("judged", "missed_ttft", "missed_tpot", "rejected_late", "served_late", "admitted", "admitted_late")


def slo_scheduling_summary(deployment, *, minutes: int = 60, now: datetime | None = None) -> dict | None:
    """What the built-in engine's SLO scheduling did for the deployment over the last `minutes`, and
    each live replica's policy and targets as last scraped; None when no replica exports them."""
    now = now or timezone.now()
    replicas = []
    for replica in deployment.replica_set.filter(state__in=ReplicaState.live()).order_by("id"):
        infos = [state.get("slo_info") for state in targets_from_json(replica.scrape_state or {}).values()]
        info = next((i for i in infos if i), None)
        if info:
            replicas.append({"id": replica.pk, "policy": info.get("policy", ""),
                             "ttft_ms": _ms(info.get("ttft_target_s")), "tpot_ms": _ms(info.get("tpot_target_s"))})
    totals: dict[str, int] = {}
    rows = ReplicaMetricsMinute.objects.filter(deployment=deployment, start__gte=now - timedelta(minutes=minutes))
    for counts in rows.exclude(slo_scheduling={}).values_list("slo_scheduling", flat=True):
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    if not replicas and not totals:
        return None
    counts = {key: totals.get(key, 0) for key in SLO_COUNT_KEYS}
    judged, admitted = counts["judged"], counts["admitted"]
    return {
        "replicas": replicas, "minutes": minutes, "counts": counts,
        "ttft_miss_share": counts["missed_ttft"] / judged if judged else None,
        "tpot_miss_share": counts["missed_tpot"] / judged if judged else None,
        "late_admission_share": counts["admitted_late"] / admitted if admitted else None,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


# ------------------------------------------------------------------- GPU telemetry summary

GPU_TELEMETRY_LOOKBACK = timedelta(days=7)  # the longest range the deployment page charts


def gpu_telemetry_summary(deployment, *, now: datetime | None = None) -> dict:
    """Whether any replica of the deployment reported GPU series lately ("measured"), why not
    ("why_none"), and the notes its live replicas' last scrapes left (a source that failed, a
    dcgm-exporter without pod mapping)."""
    now = now or timezone.now()
    measured = ReplicaMetricsMinute.objects.filter(
        deployment=deployment, start__gte=now - GPU_TELEMETRY_LOOKBACK, gpu_devices__gt=0).exists()
    notes = []
    for replica in deployment.replica_set.filter(state__in=ReplicaState.live()).order_by("id"):
        for state in targets_from_json(replica.scrape_state or {}).values():
            if state.get("gpu_note") and (replica.pk, state["gpu_note"]) not in notes:
                notes.append((replica.pk, state["gpu_note"]))
    why_none = ""
    if not measured:
        why_none = ("the deployment holds no GPUs" if not (deployment.resources or {}).get("gpu_count")
                    else "no replica of it reported GPU series in the last 7 days")
    return {"measured": measured, "why_none": why_none,
            "notes": [{"replica": pk, "note": note} for pk, note in notes]}
