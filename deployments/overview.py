"""Every deployment's health at a glance, for the home page and the deployment list: status,
ready / desired replicas, request rate, error rate and TTFT p95 over the last five minutes of the
usage ledger (each with the time of the newest request it counts), the rollout in progress, the
degradation level in force, the state of the SLOs covering it, and one verdict over all of them
(deployments.health).

One query per figure across all deployments, never one per deployment: the list and the home
page stay as fast with fifty deployments as with one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cached_property

from django.db import connection
from django.db.models import Count, F, Q, QuerySet
from django.utils import timezone

from deployments.choices import ACTIVE_ROLLOUT, ReplicaState
from deployments.health import Verdict, health_verdict
from deployments.models import Deployment, Rollout
from deployments.rollouts.gate import gate

WINDOW = timedelta(minutes=5)

# SLOs are defined on deployments (slo imports deployments), so slo registers how to read the
# states of the SLOs covering a set of deployments (SloConfig.ready): {deployment id: [slo, ...]},
# each {"pk", "name", "state", "budget_remaining"}, state "pending" before the first evaluation.
SloStates = Callable[[list[Deployment]], dict[int, list[dict]]]
_slo_states: SloStates | None = None

# Worst first, for the one state a deployment's row shows ("insufficient": too little traffic to judge).
SLO_STATE_ORDER = ("exhausted", "warning", "insufficient", "ok", "pending")


def register_slo_states(reader: SloStates) -> None:
    global _slo_states
    _slo_states = reader


@dataclass
class Figure:
    """A figure over the window and the start of the newest request it counts (None: no traffic)."""

    value: float | None
    as_of: datetime | None
    now: datetime

    @property
    def freshness(self) -> str:
        return freshness(self.as_of, self.now)


@dataclass
class DeploymentHealth:
    deployment: Deployment
    ready: int
    requests: int
    error_rate: Figure
    ttft_p95_ms: Figure
    rollout: Rollout | None = None
    slos: list[dict] = field(default_factory=list)

    @property
    def desired(self) -> int:
        return self.deployment.replicas

    @property
    def requests_per_s(self) -> float:
        return self.requests / WINDOW.total_seconds()

    @property
    def requests_per_s_text(self) -> str:
        """Two decimals, or three significant digits below 0.1/s: a request a minute is not 0.00."""
        rate = self.requests_per_s
        return "0" if not rate else f"{rate:.2f}" if rate >= 0.1 else f"{rate:.3g}"

    @property
    def error_rate_text(self) -> str:
        rate = self.error_rate.value
        return "—" if rate is None else f"{rate * 100:.2f} %"

    @property
    def degradation(self) -> dict | None:
        """The degradation level in force ({level, name, ...}), None at level 0."""
        return self.deployment.degradation or None

    @property
    def slo_state(self) -> str | None:
        """The worst state of the SLOs covering it; None without SLOs."""
        # A state not in SLO_STATE_ORDER ranks just after warning: shown, never hidden.
        rank = {state: index for index, state in enumerate(SLO_STATE_ORDER)}
        return min((slo["state"] for slo in self.slos), key=lambda state: rank.get(state, 1.5), default=None)

    @cached_property
    def verdict(self) -> Verdict:
        return health_verdict(status=self.deployment.status, ready=self.ready, desired=self.desired,
                              slos=self.slos, degradation=self.degradation, requests=self.requests,
                              error_rate=self.error_rate.value)


def freshness(at: datetime | None, now: datetime) -> str:
    """How fresh a figure is: as of 14:02:10 UTC, 40 s ago; or no traffic in 5 min."""
    if at is None:
        return f"no traffic in {int(WINDOW.total_seconds() // 60)} min"
    seconds = max(0, int((now - at).total_seconds()))
    ago = f"{seconds} s ago" if seconds < 120 else f"{seconds // 60} min ago"
    return f"as of {at.astimezone(UTC):%H:%M:%S} UTC, {ago}"


def _usage_sql() -> str:
    failed = gate().server_failure_sql
    # Latency counts the interactive requests that did not fail through the server's fault, as the
    # rollout analysis does (an offline batch's lines, batch_id set, wait by design); a request's
    # `time` is when it started.
    return f"""
    SELECT e.deployment, count(*), count(*) FILTER (WHERE {failed}), max(e.time),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.ttft_ms) FILTER (WHERE NOT {failed} AND e.batch_id IS NULL),
           max(e.time) FILTER (WHERE NOT {failed} AND e.ttft_ms IS NOT NULL AND e.batch_id IS NULL)
    FROM tenants_usageevent e
    WHERE e.deployment = ANY(%(names)s) AND e.time > %(start)s AND e.time <= %(now)s
    GROUP BY e.deployment
"""


def usage_figures(names: list[str], now: datetime) -> dict[str, tuple]:
    """{deployment name: (requests, failed, newest request, TTFT p95 ms, newest with a TTFT)}."""
    if not names:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(_usage_sql(), {"names": names, "start": now - WINDOW, "now": now})
        return {row[0]: row[1:] for row in cursor.fetchall()}


def deployment_health(deployments: QuerySet[Deployment] | None = None, *,
                      now: datetime | None = None) -> list[DeploymentHealth]:
    """Health of each deployment of the queryset (default: all, by name), in its order."""
    now = now or timezone.now()
    # Explicitly: Meta.ordering does not apply to a query with GROUP BY (the ready count).
    queryset = Deployment.objects.order_by("name") if deployments is None else deployments
    rows = list(queryset.select_related("model", "version").annotate(ready_replicas=Count(
        "replica_set", filter=Q(replica_set__state=ReplicaState.READY, replica_set__version_id=F("version_id")))))
    usage = usage_figures([d.name for d in rows], now)
    ids = [d.pk for d in rows]
    rollouts = {r.deployment_id: r for r in Rollout.objects.filter(deployment_id__in=ids, status__in=ACTIVE_ROLLOUT)}
    slos = _slo_states(rows) if _slo_states is not None and rows else {}
    health = []
    for deployment in rows:
        requests, failed, newest, ttft_p95, newest_ttft = usage.get(deployment.name, (0, 0, None, None, None))
        health.append(DeploymentHealth(
            deployment=deployment, ready=deployment.ready_replicas, requests=requests,
            error_rate=Figure(failed / requests if requests else None, newest, now),
            ttft_p95_ms=Figure(ttft_p95, newest_ttft, now),
            rollout=rollouts.get(deployment.pk), slos=slos.get(deployment.pk, []),
        ))
    return health
