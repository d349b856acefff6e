"""The capacity planner: how many replicas serve a request rate within the SLOs, and what they cost.

One replica's capacity is read off the newest goodput curve of its version on its hardware: the
offered rate at which the curve first misses the SLO, interpolated linearly between the last step
that met it and the first that did not. A step meets the SLO when

- its TTFT p95 and TPOT p95 are within the deployment's TTFT and TPOT targets (the tightest of its
  latency and goodput SLOs, slo.engine_targets), and
- its goodput is at least the SLO objective's share of its throughput (0.99: 99 % of the requests
  served met every target at once), and its failed requests at most the rest (1 %).

A step that meets the SLO above one that missed is noise, not capacity: the first miss bounds it.
Without latency targets the capacity is the throughput knee instead: the rate where throughput
stops keeping up with the rate actually sent (within 5 %).

    replicas = ceil(rps / (capacity × (1 − headroom)))     (at least 1 for any traffic, 0 for none)
    $/hour   = replicas × the price of one replica-hour     (costing's price book, now)
    $/month  = $/hour × 730
    $/MTok   = $/hour / (rps × 3600 × (input + output tokens per request of the curve)) × 10^6
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django.db.models import Q, Sum
from django.urls import reverse
from django.utils import timezone

from capacity.curves import (
    deployment_hardware,
    deployment_held,
    held_of_hardware,
    newest_curve,
    replica_usd_per_hour,
)
from capacity.models import CapacityCurve
from deployments.models import Deployment
from registry.models import ModelVersion
from slo.budget import floor_minute
from slo.choices import Scope
from slo.engine_targets import LATENCY_KINDS, deployment_targets, targets_for
from slo.models import Slo
from tenants.models import UsageMinute

HOURS_PER_MONTH = 730
STALE_AFTER = timedelta(days=30)
TRAFFIC_WINDOW = timedelta(minutes=15)
KNEE_TOLERANCE = 0.05  # throughput within 5 % of the rate sent still keeps up
DEFAULT_HEADROOM = 0.2
MAX_HEADROOM = 0.9
USD = Decimal("0.000001")
MILLION = Decimal(1_000_000)


class PlanError(ValueError):
    """No plan can be made; the message says why and what to do (the API answers it as a 400)."""


# ---------------------------------------------------------------------------- one replica's capacity


@dataclass(frozen=True)
class Goal:
    """What a replica must meet: latency targets (ms; None where no SLO sets one) and the share of
    requests that must meet them (the strictest objective among the SLOs that set them)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    objective: float | None = None

    @property
    def has_targets(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "objective": self.objective}


@dataclass(frozen=True)
class Capacity:
    rps: float  # per replica
    method: str  # "slo" or "throughput-knee"
    limited_by: str | None  # the criterion that ended it; None: none did within the curve's rates
    measured_up_to: float  # the curve's highest rate

    @property
    def beyond_range(self) -> bool:
        return self.limited_by is None


# A criterion's margin at a step: >= 0 met, < 0 missed (linear in the rate between two steps), None
# missed outright (nothing measured to interpolate).
Margin = Callable[[dict], float | None]


def slo_margins(goal: Goal, use_goodput: bool) -> dict[str, Margin]:
    margins: dict[str, Margin] = {}
    if goal.ttft_ms is not None:
        margins["ttft_p95"] = lambda p: None if p.get("ttft_p95_ms") is None else goal.ttft_ms - p["ttft_p95_ms"]
    if goal.tpot_ms is not None:
        # No TPOT measured (one-token answers) cannot miss a TPOT target.
        margins["tpot_p95"] = lambda p: goal.tpot_ms - (p.get("tpot_p95_ms") or 0.0)
    objective = goal.objective if goal.objective is not None else 1.0
    if use_goodput:
        margins["goodput"] = lambda p: (None if not p["throughput_rps"] or p.get("goodput_rps") is None
                                        else p["goodput_rps"] / p["throughput_rps"] - objective)
    margins["failed"] = lambda p: (1.0 - objective) - p["failed"] / max(1, p["completed"] + p["failed"])
    return margins


def knee_margins() -> dict[str, Margin]:
    # Against the rate actually sent where the curve has it: a short Poisson step sends more or fewer
    # requests per second than its nominal rate, by far more than 5 %.
    return {"throughput": lambda p: p["throughput_rps"] / (p.get("sent_rps") or p["rps"]) - (1 - KNEE_TOLERANCE)}


def describe_miss(name: str, point: dict, goal: Goal) -> str:
    if name == "ttft_p95":
        value = point.get("ttft_p95_ms")
        return "no request completed" if value is None else f"TTFT p95 {value:.0f} ms > {goal.ttft_ms:g} ms"
    if name == "tpot_p95":
        return f"TPOT p95 {point.get('tpot_p95_ms') or 0:.1f} ms > {goal.tpot_ms:g} ms"
    if name == "goodput":
        return (f"goodput {point.get('goodput_rps') or 0:.2f} of {point['throughput_rps']:.2f} req/s served, "
                f"under {goal.objective:g}")
    if name == "failed":
        return f"{point['failed']} of {point['completed'] + point['failed']} requests failed"
    return f"throughput {point['throughput_rps']:.2f} req/s behind the {point.get('sent_rps') or point['rps']:.2f} sent"


def replica_capacity(points: list[dict], goal: Goal, use_goodput: bool = True) -> Capacity:
    """The rate one replica serves within `goal` (or at the throughput knee without targets), read off
    `points` (rising rates). PlanError when even the lowest rate misses."""
    if not points:
        raise PlanError("The curve has no points.")
    method = "slo" if goal.has_targets else "throughput-knee"
    margins = slo_margins(goal, use_goodput) if goal.has_targets else knee_margins()

    def missed(point: dict) -> dict[str, float | None]:
        if not point["completed"]:
            return dict.fromkeys(margins)
        values = {name: margin(point) for name, margin in margins.items()}
        return {name: value for name, value in values.items() if value is None or value < 0}

    first_misses = missed(points[0])
    if first_misses:
        why = "; ".join(describe_miss(name, points[0], goal) for name in first_misses)
        raise PlanError(f"Even the curve's lowest rate, {points[0]['rps']:g} req/s, misses ({why}): one replica "
                        "cannot serve it within the SLOs. Measure lower rates, or relax the SLO targets.")
    for below, above in zip(points, points[1:], strict=False):
        misses = missed(above)
        if not misses:
            continue
        crossings = {}
        for name, margin_above in misses.items():
            margin_below = margins[name](below)
            share = 0.0 if margin_above is None else margin_below / (margin_below - margin_above)
            crossings[name] = below["rps"] + share * (above["rps"] - below["rps"])
        limited_by = min(crossings, key=crossings.get)
        return Capacity(crossings[limited_by], method, limited_by, points[-1]["rps"])
    return Capacity(points[-1]["rps"], method, None, points[-1]["rps"])


def replicas_needed(rps: float, capacity_rps: float, headroom: float) -> int:
    if rps <= 0:
        return 0
    usable = capacity_rps * (1 - headroom)
    # A hair of float slack: 16 req/s on 8 usable is 2 replicas, not 3.
    return max(1, math.ceil(rps / usable - 1e-9))


# ---------------------------------------------------------------------------- a plan


def _usd(value: Decimal | None) -> Decimal | None:
    return None if value is None else value.quantize(USD, rounding=ROUND_HALF_EVEN)


def goodput_comparable(curve: CapacityCurve, goal: Goal) -> bool:
    """Whether the curve's goodput was counted against targets at least as tight as the goal's: then a
    request good by the curve is good by the goal, and goodput is a fair (or cautious) measure."""
    if not any(point.get("goodput_rps") is not None for point in curve.points):
        return False
    limits = {"ttft": goal.ttft_ms, "tpot": goal.tpot_ms}
    return all(limit is None or (curve.slo_ms.get(name) is not None and curve.slo_ms[name] <= limit)
               for name, limit in limits.items())


def curve_document(curve: CapacityCurve, now: datetime, same_engine_args: bool) -> dict:
    return {
        "id": curve.pk, "created_at": curve.created_at, "age_s": max(0.0, (now - curve.created_at).total_seconds()),
        "source": curve.source, "deployment": curve.deployment, "hardware": curve.hardware,
        "engine_args": curve.engine_args, "same_engine_args": same_engine_args, "input_len": curve.input_len,
        "output_len": curve.output_len, "slo_ms": curve.slo_ms, "points": curve.points,
    }


def make_plan(*, curve: CapacityCurve, same_engine_args: bool, goal: Goal, rps: float, headroom: float,
              usd_per_replica_hour: Decimal | None, now: datetime, run_hint: str) -> dict:
    """The plan for `rps` on `curve` (see the module's docstring), with what it rests on and its warnings."""
    warnings = []
    use_goodput = goal.has_targets and goodput_comparable(curve, goal)
    if goal.has_targets and not use_goodput:
        warnings.append(f"Curve {curve.pk} counted goodput against {curve.slo_ms or 'no targets'}, not targets at "
                        "least as tight as the SLOs' now: capacity is judged on the p95s and failed requests alone.")
    if not goal.has_targets:
        warnings.append("No latency or goodput SLO sets a TTFT or TPOT target: the capacity per replica is the "
                        "throughput knee (where throughput stops keeping up with the rate sent), not an SLO's.")
    capacity = replica_capacity(curve.points, goal, use_goodput)
    if capacity.beyond_range:
        warnings.append(f"The curve never reached its limit (up to {capacity.measured_up_to:g} req/s, the highest "
                        f"rate measured): one replica serves at least that, taken as its capacity, so the plan may "
                        f"ask for more replicas than needed. Measure higher rates for a tighter plan ({run_hint}).")
    if not same_engine_args:
        warnings.append(f"No curve of this version and hardware at these engine arguments: curve {curve.pk} was "
                        f"measured at {curve.engine_args or 'the defaults'}.")
    if now - curve.created_at > STALE_AFTER:
        warnings.append(f"Curve {curve.pk} is {(now - curve.created_at).days} days old (more than "
                        f"{STALE_AFTER.days}): measure again ({run_hint}).")
    if usd_per_replica_hour is None:
        warnings.append("The price book prices nothing a replica holds: no cost (add prices under /costing/prices/).")
    replicas = replicas_needed(rps, capacity.rps, headroom)
    tokens_per_hour = rps * 3600 * (curve.input_len + curve.output_len)
    usd_per_hour = None if usd_per_replica_hour is None else usd_per_replica_hour * replicas
    usd_per_mtok = (usd_per_hour / Decimal(str(tokens_per_hour)) * MILLION
                    if usd_per_hour is not None and tokens_per_hour else None)
    return {
        "rps": rps, "headroom": headroom, "replicas": replicas,
        "capacity_rps_per_replica": capacity.rps,
        "usable_rps_per_replica": capacity.rps * (1 - headroom),
        "utilization": rps / (replicas * capacity.rps) if replicas else 0.0,
        "capacity_method": capacity.method, "limited_by": capacity.limited_by,
        "slo": goal.as_dict(), "goodput_judged": use_goodput,
        "usd_per_replica_hour": _usd(usd_per_replica_hour), "usd_per_hour": _usd(usd_per_hour),
        "usd_per_month": _usd(None if usd_per_hour is None else usd_per_hour * HOURS_PER_MONTH),
        "usd_per_mtok": _usd(usd_per_mtok), "tokens_per_hour": tokens_per_hour,
        "curve": curve_document(curve, now, same_engine_args), "warnings": warnings,
    }


def strictest_objective(slos) -> float | None:
    """The strictest objective among the latency and goodput SLOs that set a TTFT or TPOT target."""
    objectives = [slo.objective for slo in slos if slo.sli_kind in LATENCY_KINDS and slo.objective
                  and ((slo.ttft_ms or 0) > 0 or (slo.tpot_ms or 0) > 0)]
    return max(objectives) if objectives else None


def deployment_goal(deployment: Deployment) -> Goal:
    """The deployment's SLO targets, as its replicas are given them (slo.engine_targets), and objective."""
    targets = deployment_targets(deployment)
    slos = Slo.objects.filter(Q(scope=Scope.DEPLOYMENT, deployment=deployment)
                              | Q(scope=Scope.MODEL, model_id=deployment.model_id), sli_kind__in=LATENCY_KINDS)
    return Goal(targets["ttft_ms"], targets["tpot_ms"], strictest_objective(slos))


def model_goal(version: ModelVersion) -> Goal:
    """The targets of the SLOs on the version's whole model (no deployment named)."""
    slos = list(Slo.objects.filter(scope=Scope.MODEL, model_id=version.model_id, sli_kind__in=LATENCY_KINDS))
    targets = targets_for(slos)
    return Goal(targets["ttft_ms"], targets["tpot_ms"], strictest_objective(slos))


def capacity_runs_url(deployment_name: str) -> str:
    return reverse("api-capacity-runs", args=[deployment_name])


def plan_for_deployment(deployment: Deployment, rps: float, headroom: float = DEFAULT_HEADROOM,
                        now: datetime | None = None) -> dict:
    now = now or timezone.now()
    hardware = deployment_hardware(deployment)
    curve, same = newest_curve(deployment.version, hardware, deployment.engine_args)
    run_hint = f"POST {capacity_runs_url(deployment.name)}"
    if curve is None:
        raise PlanError(f"No goodput curve of {deployment.model.name} v{deployment.version.number} on {hardware}: "
                        f"run a capacity run first: {run_hint} (or `inferops bench --rates ... --save-curve "
                        f"{deployment.name}`).")
    plan = make_plan(curve=curve, same_engine_args=same, goal=deployment_goal(deployment), rps=rps,
                     headroom=headroom, usd_per_replica_hour=replica_usd_per_hour(deployment_held(deployment), now),
                     now=now, run_hint=run_hint)
    return {"deployment": deployment.name, "model": deployment.model.name, "version": deployment.version.number,
            "hardware": hardware, "engine_args": deployment.engine_args, **plan}


def plan_for_version(version: ModelVersion, hardware: str, rps: float, headroom: float = DEFAULT_HEADROOM,
                     now: datetime | None = None) -> dict:
    now = now or timezone.now()
    curve, same = newest_curve(version, hardware)
    run_hint = "POST /api/v1/deployments/{name}/capacity-runs/ on a deployment of it"
    if curve is None:
        raise PlanError(f"No goodput curve of {version.model.name} v{version.number} on {hardware}: run a capacity "
                        f"run first: {run_hint} (or `inferops bench --rates ... --save-curve DEPLOYMENT`).")
    held = held_of_hardware(hardware)
    price = None if held is None else replica_usd_per_hour(held, now)
    plan = make_plan(curve=curve, same_engine_args=same, goal=model_goal(version), rps=rps, headroom=headroom,
                     usd_per_replica_hour=price, now=now, run_hint=run_hint)
    if held is not None:
        plan["warnings"].append("Priced from the hardware key alone (its GPUs or cores; no memory or node "
                                "prices): plan by deployment for what its replicas really hold.")
    return {"deployment": None, "model": version.model.name, "version": version.number, "hardware": hardware,
            "engine_args": curve.engine_args, **plan}


def recent_rps(deployment: Deployment, now: datetime | None = None, window: timedelta = TRAFFIC_WINDOW) -> float:
    """Interactive requests per second the deployment received over the last whole minutes of `window`,
    from the usage ledger (offline batch lines left out: they fill idle capacity, they do not ask for it)."""
    end = floor_minute(now or timezone.now())
    totals = UsageMinute.objects.filter(deployment=deployment.name, minute__gte=end - window, minute__lt=end).aggregate(
        requests=Sum("requests"), batch=Sum("batch_requests"))
    return max(0, (totals["requests"] or 0) - (totals["batch"] or 0)) / window.total_seconds()


def deployment_capacity(deployment: Deployment) -> Capacity | None:
    """One replica's capacity at the deployment's SLOs from its newest curve; None without a usable one.
    (For the autoscaler's goodput_headroom signal: capacity.autoscaler.Targets.capacity_rps.)"""
    curve, _ = newest_curve(deployment.version, deployment_hardware(deployment), deployment.engine_args)
    if curve is None:
        return None
    goal = deployment_goal(deployment)
    try:
        return replica_capacity(curve.points, goal, goal.has_targets and goodput_comparable(curve, goal))
    except PlanError:
        return None
