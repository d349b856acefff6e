"""The control plane's own Prometheus metrics (`/metrics`), read from Postgres and Redis at scrape time.

The web server runs several worker processes and the Celery workers run elsewhere, so no process
holds the truth in memory: the collector reads the rows the console reads (SloStatus, SloMinute,
Alert, DegradationState, Rollout) and the Redis keys the workers write, once per scrape. Any web
worker answers with the same figures.

Celery task failures are counted in a Redis hash by a `task_failure` signal handler
(inferops/celery.py): it is the one store every worker process on every host shares, it survives a
worker's restart (a per-process prometheus_client counter would reset and be invisible to web),
and HINCRBY is atomic. A Redis flush resets it, which Prometheus' rate() reads as a counter reset.

Scraped with the same credentials as the service-discovery endpoint: a viewer's API token as
Prometheus' `authorization` block sends it (`Authorization: Bearer <token>`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from django.db.models import Count
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError
from rest_framework.views import APIView

from alerts.choices import AlertStatus, Severity
from alerts.models import Alert
from degradation.models import DegradationState
from deployments.choices import ACTIVE_ROLLOUT, RolloutStatus
from deployments.models import Deployment, ReplicaStart, Rollout
from inferops.api import ERRORS
from inferops.celery import TASK_FAILURES_KEY
from inferops.prometheus_auth import SCRAPER_AUTHENTICATION
from inferops.redis_client import redis_client
from inferops.roles import VIEWER
from slo.models import Slo, SloMinute
from tenants.ingest import GROUP as USAGE_GROUP
from tenants.ingest import STREAM_KEY as USAGE_STREAM


def gauge(name: str, help_text: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, labels=list(labels))


class ControlPlaneCollector(Collector):
    """Every family of the control plane's /metrics; Redis families are absent while Redis is down."""

    def collect(self) -> Iterator[Metric]:
        yield from slo_families()
        yield from alert_families()
        yield from deployment_families()
        yield from cold_start_families()
        redis_up = gauge("inferops_control_plane_redis_up", "1 when this scrape could read Redis")
        try:
            families = list(usage_families()) + list(celery_families())
        except (RedisError, OSError):
            families = []
        redis_up.add_metric([], 1 if families else 0)
        yield redis_up
        yield from families


def slo_families() -> Iterator[Metric]:
    remaining = gauge("inferops_slo_error_budget_remaining_ratio",
                      "Fraction of the error budget left at the last evaluation; negative when overspent", ("slo",))
    consumed = gauge("inferops_slo_error_budget_consumed", "Bad events (or bad minutes) spent in the window", ("slo",))
    burn = gauge("inferops_slo_burn_rate", "Error ratio over the window divided by the budgeted ratio",
                 ("slo", "window"))
    sli = gauge("inferops_slo_sli_ratio", "The SLI over the SLO's window (absent without events)", ("slo",))
    objective = gauge("inferops_slo_objective_ratio", "The SLO's objective", ("slo",))
    window_good = gauge("inferops_slo_window_good_events", "Good events in the SLO's current window", ("slo",))
    window_total = gauge("inferops_slo_window_events", "Events in the SLO's current window", ("slo",))
    good = CounterMetricFamily("inferops_slo_sli_good_events", "Good events since the SLO began", labels=["slo"])
    total = CounterMetricFamily("inferops_slo_sli_events", "Events since the SLO began", labels=["slo"])
    state = gauge("inferops_slo_state", "1 for the SLO's state at the last evaluation", ("slo", "state"))
    evaluated = gauge("inferops_slo_last_evaluation_timestamp_seconds", "When the SLO was last evaluated", ("slo",))
    slos = list(Slo.objects.select_related("status").order_by("name"))
    # Running totals of each SLO's newest minute row (kept through pruning, slo.evaluation.prune_minutes).
    latest = {row.slo_id: row for row in SloMinute.objects.filter(slo__in=slos)
              .order_by("slo_id", "-minute").distinct("slo_id")}
    for slo in slos:
        labels = [slo.name]
        objective.add_metric(labels, slo.objective)
        if (row := latest.get(slo.pk)) is not None:
            good.add_metric(labels, row.cum_good)
            total.add_metric(labels, row.cum_total)
        status = getattr(slo, "status", None)
        if status is None or status.evaluated_at is None:
            continue
        remaining.add_metric(labels, status.budget_remaining)
        consumed.add_metric(labels, status.budget_consumed)
        for window, rate in sorted(status.burn_rates.items()):
            burn.add_metric([slo.name, window], rate)
        if status.sli is not None:
            sli.add_metric(labels, status.sli)
        window_good.add_metric(labels, status.good)
        window_total.add_metric(labels, status.total)
        state.add_metric([slo.name, status.state], 1)
        evaluated.add_metric(labels, status.evaluated_at.timestamp())
    yield from (remaining, consumed, burn, sli, objective, window_good, window_total, good, total, state, evaluated)


def alert_families() -> Iterator[Metric]:
    family = gauge("inferops_alerts_open", "Alerts not resolved, by severity and status (firing, acknowledged)",
                   ("severity", "status"))
    open_statuses = [AlertStatus.FIRING, AlertStatus.ACKNOWLEDGED]
    counts = {(row["severity"], row["status"]): row["n"] for row in
              Alert.objects.filter(status__in=open_statuses).values("severity", "status").annotate(n=Count("id"))}
    # Every pair, zeros included: a panel or alert on "firing pages > 0" needs the series to exist.
    for severity in Severity.values:
        for status in open_statuses:
            family.add_metric([severity, status], counts.get((severity, status), 0))
    yield family


def deployment_families() -> Iterator[Metric]:
    level = gauge("inferops_degradation_level", "The deployment's degradation level in force (0: normal)",
                  ("deployment",))
    rollout_state = gauge("inferops_rollout_status", "1 for the status of the deployment's latest rollout",
                          ("deployment", "status", "strategy"))
    weight = gauge("inferops_rollout_candidate_weight_percent", "Traffic on the candidate of an active rollout",
                   ("deployment",))
    step = gauge("inferops_rollout_step_index", "Steps done by the active rollout", ("deployment",))
    steps = gauge("inferops_rollout_steps", "Steps of the active rollout", ("deployment",))
    deployments = list(Deployment.objects.filter(deleted_at__isnull=True).order_by("name"))
    levels = dict(DegradationState.objects.filter(deployment__in=deployments).values_list("deployment_id", "level"))
    latest = {r.deployment_id: r for r in Rollout.objects.filter(deployment__in=deployments)
              .order_by("deployment_id", "-id").distinct("deployment_id")}
    for deployment in deployments:
        level.add_metric([deployment.name], levels.get(deployment.pk, 0))
        rollout = latest.get(deployment.pk)
        if rollout is None:
            continue
        for status in RolloutStatus.values:
            rollout_state.add_metric([deployment.name, status, rollout.strategy], 1 if rollout.status == status else 0)
        if rollout.status in ACTIVE_ROLLOUT:
            weight.add_metric([deployment.name], rollout.weight)
            step.add_metric([deployment.name], rollout.step_index)
            steps.add_metric([deployment.name], len(rollout.steps))
    yield from (level, rollout_state, weight, step, steps)


def cold_start_families() -> Iterator[Metric]:
    """Each deployment's latest replica start that became ready, phase by phase, and starts by cause."""
    seconds = gauge("inferops_replica_cold_start_seconds",
                    "Seconds from asking for a replica to the end of each phase of its cold start (process, "
                    "weights_loaded, ready, first_token), of the deployment's latest start that became ready; "
                    "a phase the replica does not report (vLLM: weights_loaded, first_token) is absent",
                    ("deployment", "phase"))
    starts = CounterMetricFamily("inferops_replica_starts", "Replica starts the reconcile loop asked for, by cause "
                                 "(scale, restart, from_zero)", labels=["deployment", "cause"])
    names = dict(Deployment.objects.filter(deleted_at__isnull=True).values_list("pk", "name"))
    latest = (ReplicaStart.objects.filter(deployment_id__in=names, ready_at__isnull=False, failed=False)
              .order_by("deployment_id", "-started_at", "-id").distinct("deployment_id"))
    for start in sorted(latest, key=lambda s: names[s.deployment_id]):
        for phase, value in start.seconds().items():
            if value is not None:
                seconds.add_metric([names[start.deployment_id], phase], value)
    counts = (ReplicaStart.objects.filter(deployment_id__in=names).values("deployment_id", "cause")
              .annotate(n=Count("id")).order_by("deployment_id", "cause"))
    for row in sorted(counts, key=lambda r: (names[r["deployment_id"]], r["cause"])):
        starts.add_metric([names[row["deployment_id"]], row["cause"]], row["n"])
    yield from (seconds, starts)


def entry_time_s(entry_id: bytes | str) -> float:
    """A stream entry id's milliseconds part, the time Redis appended it."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0]) / 1000


def usage_families(now: float | None = None) -> Iterator[Metric]:
    """The gateways' usage stream as the ingestion worker (tenants/ingest.py) sees it.

    The lag is the age of the oldest event ingestion has not acknowledged: the first one it was
    handed but did not acknowledge (pending), or else the first it has not been handed yet."""
    client = redis_client()
    length = client.xlen(USAGE_STREAM)
    groups = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
              for g in (client.xinfo_groups(USAGE_STREAM) if length or client.exists(USAGE_STREAM) else [])}
    group = groups.get(USAGE_GROUP)
    pending_count, oldest = 0, None
    if group is not None:
        summary = client.xpending(USAGE_STREAM, USAGE_GROUP)
        pending_count = summary["pending"]
        if pending_count:
            oldest = entry_time_s(summary["min"])
        else:
            after = client.xrange(USAGE_STREAM, min=f"({group['last-delivered-id'].decode()}", count=1)
            oldest = entry_time_s(after[0][0]) if after else None
    elif length:
        oldest = entry_time_s(client.xrange(USAGE_STREAM, count=1)[0][0])
    now = time.time() if now is None else now
    stream = gauge("inferops_usage_stream_length", "Usage events held in the Redis stream: not yet ingested "
                   "(ingestion deletes what it acknowledges)")
    stream.add_metric([], length)
    pending = gauge("inferops_usage_stream_pending", "Usage events handed to an ingestion worker and not acknowledged")
    pending.add_metric([], pending_count)
    lag = gauge("inferops_usage_ingest_lag_seconds", "Age of the oldest usage event not yet ingested (0: none)")
    lag.add_metric([], max(0.0, now - oldest) if oldest is not None else 0.0)
    yield from (stream, pending, lag)


def celery_families() -> Iterator[Metric]:
    failures = CounterMetricFamily("inferops_celery_task_failures", "Celery tasks that raised, by task name",
                                   labels=["task"])
    for name, count in sorted(redis_client().hgetall(TASK_FAILURES_KEY).items()):
        failures.add_metric([name.decode()], int(count))
    yield failures


def registry() -> CollectorRegistry:
    """A registry holding only the collector; built per scrape, so registering it reads nothing."""
    built = CollectorRegistry()
    built.register(ControlPlaneCollector())
    return built


@extend_schema(tags=["prometheus"], summary="The control plane's own metrics (Prometheus text format)",
               description="SLO budgets and burn rates, SLI event counters, open alerts, degradation levels, "
                           "rollout state, replica cold starts, usage ingestion lag and Celery task failures, read "
                           "at scrape time. "
                           "Authenticate as for the service-discovery endpoint: "
                           "`authorization: {credentials: <viewer API token>}`.",
               responses={(200, "text/plain"): OpenApiResponse(OpenApiTypes.STR), **ERRORS})
class ControlPlaneMetrics(APIView):
    authentication_classes = SCRAPER_AUTHENTICATION
    read_role = VIEWER

    def get(self, request):
        return HttpResponse(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)
