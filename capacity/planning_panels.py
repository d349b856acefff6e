"""The capacity plan panel of the deployment page: replicas and money for the current traffic and for a
rate the person types (`?plan_rps=20`), the goodput curve the plan rests on as a chart, the recent
capacity runs, and for operators the button that starts one."""

from __future__ import annotations

import math

from django.template.loader import render_to_string
from django.utils import timezone

from capacity import runs
from capacity.choices import ACTIVE_RUN
from capacity.curves import deployment_hardware, newest_curve
from capacity.planner import (
    DEFAULT_HEADROOM,
    MAX_HEADROOM,
    STALE_AFTER,
    TRAFFIC_WINDOW,
    PlanError,
    deployment_goal,
    plan_for_deployment,
    recent_rps,
)
from deployments.models import Deployment
from deployments.panels import register
from inferops.roles import OPERATOR, has_role

CAPACITY_PLAN = 35  # right after autoscaling (30), which reads the same capacity
RUNS_SHOWN = 5
MAX_TYPED_RPS = 1_000_000


def typed_number(raw: str | None, low: float, high: float, what: str) -> tuple[float | None, str]:
    """A number typed into the panel's form, and what is wrong with it ("" when nothing)."""
    if raw is None or not raw.strip():
        return None, ""
    try:
        value = float(raw)
    except ValueError:
        return None, f"{what}: {raw[:40]!r} is not a number."
    if not math.isfinite(value) or not low <= value <= high:
        return None, f"{what}: from {low:g} to {high:g}."
    return value, ""


def plan_or_error(deployment: Deployment, rps: float, headroom: float, now) -> tuple[dict | None, str]:
    try:
        return plan_for_deployment(deployment, rps, headroom, now), ""
    except PlanError as exc:
        return None, str(exc)


def chart_data(curve, goal, capacity_rps: float | None) -> dict:
    points = curve.points
    return {
        "rps": [p["rps"] for p in points], "ttft": [p.get("ttft_p95_ms") for p in points],
        "tpot": [p.get("tpot_p95_ms") for p in points], "goodput": [p.get("goodput_rps") for p in points],
        "throughput": [p["throughput_rps"] for p in points],
        "ttft_target": goal.ttft_ms, "tpot_target": goal.tpot_ms, "capacity": capacity_rps,
    }


def capacity_plan_panel(request, deployment: Deployment) -> str:
    now = timezone.now()
    curve, same_engine_args = newest_curve(deployment.version, deployment_hardware(deployment), deployment.engine_args)
    headroom, headroom_error = typed_number(request.GET.get("plan_headroom"), 0, MAX_HEADROOM, "Headroom")
    typed_rps, rps_error = typed_number(request.GET.get("plan_rps"), 0, MAX_TYPED_RPS, "Requests per second")
    headroom = DEFAULT_HEADROOM if headroom is None else headroom
    current_rps = recent_rps(deployment, now)
    rows, plan_error = [], ""
    if curve is not None:
        for label, rps in (("Current traffic", current_rps), ("Typed rate", typed_rps)):
            if rps is None:
                continue
            plan, plan_error = plan_or_error(deployment, rps, headroom, now)
            if plan is None:
                break
            rows.append({"label": label, "plan": plan})
    goal = deployment_goal(deployment)
    recent = list(deployment.capacity_runs.select_related("created_by")[:RUNS_SHOWN])
    context = {
        "deployment": deployment, "curve": curve, "same_engine_args": same_engine_args,
        "stale": curve is not None and now - curve.created_at > STALE_AFTER,
        "hardware": deployment_hardware(deployment), "goal": goal, "rows": rows, "plan_error": plan_error,
        "warnings": rows[0]["plan"]["warnings"] if rows else [],
        "current_rps": current_rps, "window_min": int(TRAFFIC_WINDOW.total_seconds() // 60),
        "typed_rps": request.GET.get("plan_rps", ""), "headroom": headroom,
        "typed_headroom": request.GET.get("plan_headroom", ""), "input_errors": [e for e in (rps_error,
                                                                                           headroom_error) if e],
        "chart": chart_data(curve, goal, rows[0]["plan"]["capacity_rps_per_replica"] if rows else None)
        if curve is not None else None,
        "runs": recent,
        "active_run": next((run for run in recent if run.status in ACTIVE_RUN and not runs.stale_reason(run, now)),
                           None),
        "operator": has_role(request.user, OPERATOR),
        "default_rates": ", ".join(f"{rate:g}" for rate in runs.DEFAULT_RATES), "default_step_s": runs.DEFAULT_STEP_S,
        "max_steps": runs.MAX_STEPS, "step_range": runs.STEP_S_RANGE,
    }
    return render_to_string("capacity/_plan_panel.html", context, request=request)


register(capacity_plan_panel, CAPACITY_PLAN)
