"""The autoscaler at work: sample each autoscaled deployment, decide, apply; wake parked ones.

Every tick (INFEROPS_AUTOSCALE_INTERVAL_S) each deployment with autoscaling on is sampled: its
ready replicas' /metrics fetched at once (queue, running, KV usage, finished requests and latency
histograms, as deltas since the previous sample), its SLOs' fastest burn rate, and whether a
gateway holds requests for it. The samples of the longest window are kept on its ScalingState;
`autoscaler.decide` turns them into a replica count, and a change is written to the deployment
(with a ScalingDecision and an audit event) for the reconcile loop to act on.

Waking is faster than a tick: gateways that hold requests for a parked deployment say so in
Redis (runtime/gateway/contract.py ACTIVATION_KEY), `wake_requested` (every
INFEROPS_WAKE_POLL_S) hands each to `wake`, which scales the deployment to one replica and runs
reconcile passes a quarter of a second apart until it is ready (the task runs again rather than
sleeping in its worker slot), so the held requests go as soon as it is.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from capacity.autoscaler import LATENCY_WINDOW_S, Decision, Sample, Targets, decide
from capacity.choices import DecisionKind
from capacity.models import ScalingDecision, ScalingState
from capacity.planner import deployment_capacity
from capacity.policy import DEFAULTS, document, policy_of
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica
from deployments.replicas import reconcile
from deployments.replicas.cold_start import record_cold_start
from deployments.replicas.scraping import MetricsFetcher, ScrapeTarget
from deployments.services import request_reconcile
from inferops.audit import audit_record
from inferops.celery import enqueue
from inferops.locks import LockId, try_advisory_lock
from inferops.redis_client import redis_client
from runtime.gateway.contract import ACTIVATION_KEY
from slo.choices import SliKind
from slo.engine_targets import deployment_targets
from slo.models import Slo, SloStatus

logger = logging.getLogger(__name__)

# Samples older than the longest window they serve, plus this, are dropped.
KEEP_EXTRA_S = 120


def _scrape(replicas: list[Replica]) -> dict[int, dict]:
    """Each reachable ready replica's raw values: gauges, finished requests, latency histograms."""
    results = MetricsFetcher(connect_timeout=1.0, total_timeout=3.0).fetch_all(
        ScrapeTarget(replica.pk, replica.url) for replica in replicas)
    raw = {}
    for result in results:
        if result.sample is None:
            continue
        sample = result.sample
        raw[result.replica_id] = {
            "gauges": sample.gauges,
            "requests": sum(sample.requests_by_reason.values()),
            "ttft": sample.histograms["ttft"].buckets if "ttft" in sample.histograms else {},
            "itl": sample.histograms["itl"].buckets if "itl" in sample.histograms else {},
        }
    return raw


def _delta(now: dict[str, float], before: dict[str, float] | None) -> dict[str, float]:
    if before is None or any(now.get(le, 0) < count for le, count in before.items()):
        return {}  # a new replica, or a restarted one: no interval to speak of yet
    delta = {le: count - before.get(le, 0) for le, count in now.items()}
    return delta if any(delta.values()) else {}  # nothing observed: kept as nothing


def burn_rate(deployment: Deployment) -> float | None:
    """The fastest 5-minute burn among the deployment's SLOs that more replicas can help (not quality)."""
    slos = Slo.objects.filter(Q(deployment=deployment) | Q(model_id=deployment.model_id, deployment__isnull=True))
    rates = [status.burn_rates.get("5m") for status in SloStatus.objects.filter(
        slo__in=slos.exclude(sli_kind=SliKind.QUALITY))]
    rates = [rate for rate in rates if rate is not None]
    return max(rates) if rates else None


def held_deployments() -> set[str]:
    try:
        return {name.decode() for name in redis_client().hkeys(ACTIVATION_KEY)}
    except OSError as exc:  # Redis down: no wake requests can be read, nothing else changes
        logger.warning("autoscaler: cannot read wake requests: %s", exc)
        return set()


def take_sample(deployment: Deployment, state: ScalingState, now: float, held: bool) -> tuple[Sample, dict]:
    """Sample the deployment now, and the raw values the next sample's rates and deltas start from
    (the previous sample's give this one's)."""
    ready = list(deployment.replica_set.filter(state=ReplicaState.READY).exclude(url=""))
    raw = _scrape(ready) if ready else {}
    previous = state.samples[-1] if state.samples else None
    before = (previous or {}).get("raw", {})
    elapsed = now - previous["at"] if previous else 0
    finished, ttft, itl = 0.0, {}, {}
    comparable = False
    for replica_id, values in raw.items():
        old = before.get(str(replica_id))
        if old is None or values["requests"] < old["requests"]:
            continue
        comparable = True
        finished += values["requests"] - old["requests"]
        for total, name in ((ttft, "ttft"), (itl, "itl")):
            for le, count in _delta(values[name], old[name]).items():
                total[le] = total.get(le, 0.0) + count
    gauges = [values["gauges"] for values in raw.values()]
    return Sample(
        at=now, replicas=deployment.replicas, ready=len(raw),
        waiting=sum(g.get("waiting", 0.0) for g in gauges), running=sum(g.get("running", 0.0) for g in gauges),
        kv=sum(g.get("kv_cache_usage", 0.0) for g in gauges) / len(gauges) if gauges else 0.0,
        rps=finished / elapsed if comparable and elapsed > 0 else None,
        ttft_buckets=ttft, itl_buckets=itl, burn=burn_rate(deployment), held=held,
    ), {str(replica_id): {key: values[key] for key in ("requests", "ttft", "itl")}
        for replica_id, values in raw.items()}


def targets_of(deployment: Deployment) -> Targets:
    slo = deployment_targets(deployment)
    capacity = deployment_capacity(deployment)
    return Targets(ttft_ms=slo.get("ttft_ms"), tpot_ms=slo.get("tpot_ms"),
                   capacity_rps=capacity.rps if capacity else None)


def _lean(sample: Sample) -> dict:
    return {**sample.as_json(), "ttft_buckets": {}, "itl_buckets": {}}


def record_decision(deployment: Deployment, target: int, kind: str, reason: str, signals: dict,
                    now: datetime | None = None, save: bool = True) -> ScalingDecision | None:
    """Set the deployment's replica count with why: a ScalingDecision, an audit event, a reconcile. With
    `save`, only if the count is still the one decided on (a wake or an operator may have changed it
    meanwhile: then None, and nothing is written)."""
    now = now or timezone.now()
    before = deployment.replicas
    if save and not Deployment.objects.filter(pk=deployment.pk, replicas=before).update(replicas=target,
                                                                                       last_scaled_at=now):
        return None
    decision = ScalingDecision.objects.create(deployment=deployment, at=now, kind=kind, from_replicas=before,
                                              to_replicas=target, reason=reason, signals=signals)
    deployment.replicas, deployment.last_scaled_at = target, now
    audit_record(actor=None, action="deployment.autoscale", obj=deployment, before={"replicas": before},
                 after={"replicas": target, "reason": reason, "kind": kind})
    request_reconcile(deployment)
    return decision


def autoscale(deployment_id: int, now: float | None = None, held: set[str] | None = None) -> Decision | None:
    """One tick for one deployment; None when it is not autoscaled (or another worker is on it)."""
    with try_advisory_lock(LockId.AUTOSCALE, deployment_id) as acquired:
        if not acquired:
            return None
        deployment = Deployment.objects.select_related("model").filter(pk=deployment_id).first()
        if deployment is None or not deployment.autoscale or deployment.paused or deployment.deleted_at:
            return None
        now = time.time() if now is None else now
        policy = policy_of(deployment)
        state, _ = ScalingState.objects.get_or_create(deployment=deployment)
        held = held_deployments() if held is None else held
        sample, raw = take_sample(deployment, state, now, deployment.name in held)
        windows = (policy.scale_up.stabilization_s, policy.scale_down.stabilization_s, policy.park_after_s)
        keep = max(windows) + KEEP_EXTRA_S
        series = [Sample.from_json(s) for s in state.samples if s["at"] >= now - keep] + [sample]
        boost = int((deployment.degradation or {}).get("scale_up") or 0)
        last = deployment.last_scaled_at.timestamp() if deployment.last_scaled_at else None
        decision = decide(policy=policy, samples=series, current=deployment.replicas, last_change_at=last, now=now,
                          targets=targets_of(deployment), boost=boost)
        with transaction.atomic():
            # Histograms only as far back as a latency signal looks at them: the rest of the series
            # serves the idle rule, which needs none, and it is written every tick.
            histograms_from = now - max(windows[:2]) - LATENCY_WINDOW_S
            state.samples = [_lean(s) if s.at < histograms_from else s.as_json() for s in series[:-1]] + [
                {**sample.as_json(), "raw": raw}]
            state.save(update_fields=["samples", "updated_at"])
            if decision.changes:
                record_decision(deployment, decision.target, decision.kind, decision.reason, decision.signals,
                                now=datetime.fromtimestamp(now, tz=UTC))
        return decision


def autoscale_all() -> int:
    """Beat: a tick for every autoscaled deployment (each under its own lock)."""
    held = held_deployments()
    ids = list(Deployment.objects.filter(autoscale=True, paused=False, deleted_at__isnull=True)
               .values_list("pk", flat=True))
    for deployment_id in ids:
        try:
            autoscale(deployment_id, held=held)
        except Exception:  # one deployment's trouble must not stop the others' scaling
            logger.exception("autoscaling deployment %s failed", deployment_id)
    return len(ids)


def wake_requested() -> list[int]:
    """Beat (every INFEROPS_WAKE_POLL_S): the parked deployments gateways hold requests for, to wake."""
    client = redis_client()
    try:
        wanted = client.hgetall(ACTIVATION_KEY)
    except OSError as exc:
        logger.warning("cannot read wake requests: %s", exc)
        return []
    if not wanted:
        return []
    names = {name.decode(): value for name, value in wanted.items()}
    parked = list(Deployment.objects.filter(name__in=names, autoscale=True, paused=False, deleted_at__isnull=True)
                  .exclude(replica_set__state=ReplicaState.READY).values_list("pk", "name").distinct())
    for name, value in names.items():
        # Only the request seen here is answered: a gateway that asks again meanwhile stays asked.
        client.eval("if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end",
                    1, ACTIVATION_KEY, name, value)
    for deployment_id, name in parked:
        logger.info("waking %s for requests held at %s", name, json.loads(names[name]).get("gateway", "a gateway"))
        enqueue("capacity.wake_deployment", deployment_id)
    return [deployment_id for deployment_id, _ in parked]


def wake(deployment_id: int) -> str:
    """Scale a parked deployment to one replica and run a reconcile pass: "ready" once a replica is,
    "starting" while none is yet (the task runs it again shortly), "busy" or "gone"."""
    with try_advisory_lock(LockId.WAKE, deployment_id) as acquired:
        if not acquired:
            return "busy"
        deployment = Deployment.objects.filter(pk=deployment_id).first()
        if deployment is None or not deployment.autoscale or deployment.paused or deployment.deleted_at:
            return "gone"
        if deployment.replicas == 0:
            with transaction.atomic():
                locked = Deployment.objects.select_for_update().get(pk=deployment_id)
                if locked.replicas == 0:
                    now = time.time()
                    held = Sample(at=now, replicas=0, ready=0, held=True)
                    decision = decide(policy=policy_of(locked), samples=[held], current=0, last_change_at=None,
                                      now=now)
                    record_decision(locked, decision.target, decision.kind, decision.reason, {})
        reconcile.reconcile_deployment(deployment_id)
        ready = Replica.objects.filter(deployment_id=deployment_id, state=ReplicaState.READY).first()
        return "ready" if ready else "starting"


def record_woken_start(deployment_id: int) -> bool:
    """Fill the phases of the ready replica's latest start from its /metrics; whether the first token is in."""
    replica = (Replica.objects.filter(deployment_id=deployment_id, state=ReplicaState.READY)
               .order_by("-ready_at").first())
    if replica is None:
        return False
    start = record_cold_start(replica)
    return start is not None and start.first_token_at is not None


def policy_save(*, deployment: Deployment, actor, data: dict) -> Deployment:
    """Write a validated policy (AutoscalingPolicySerializer's data) and audit it. A deployment outside its new
    bounds is brought inside them at once, recorded as the autoscaler's decision."""
    stored = {key: _plain(data[key]) for key in DEFAULTS if key in data}
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        before = document(locked)
        locked.autoscale = data["enabled"]
        locked.min_replicas, locked.max_replicas = data["min_replicas"], data["max_replicas"]
        locked.autoscaling = stored
        fields = ["autoscale", "min_replicas", "max_replicas", "autoscaling"]
        bounded = min(max(locked.replicas, locked.min_replicas), locked.max_replicas)
        if bounded != locked.replicas:
            reason = f"policy changed: min_replicas {locked.min_replicas}, max_replicas {locked.max_replicas}"
            record_decision(locked, bounded, DecisionKind.BOUND, reason, {}, save=False)
            fields += ["replicas", "last_scaled_at"]
        locked.save(update_fields=fields)
        audit_record(actor=actor, action="deployment.autoscaling", obj=locked, before=before, after=document(locked))
    return locked


def _plain(value):
    return {key: _plain(item) for key, item in value.items()} if isinstance(value, dict) else value
