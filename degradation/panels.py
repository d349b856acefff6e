"""The degradation panel of the deployment page: where the deployment stands and why, a timeline
and a chart of its levels over the SLOs' burn, and for operators the console forms (views.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.template.loader import render_to_string
from django.utils import timezone

from degradation import services
from degradation.api import quality_document, state_document
from degradation.engine import burn_rate_series, watched_slos
from degradation.models import DegradationPolicy, LevelChange
from degradation.quality import percent
from degradation.views import OverrideForm, PolicyForm
from deployments.models import Deployment
from inferops.roles import OPERATOR, has_role
from slo.budget import MINUTE, floor_minute

CHART_SPAN = timedelta(hours=6)
# A policy minutes old is charted over this much, so its window's burn has room to show.
CHART_SPAN_MIN = timedelta(minutes=15)


def degradation_panel(request, deployment: Deployment) -> str:
    policy = DegradationPolicy.objects.filter(deployment=deployment).prefetch_related("slos").first()
    # A form that failed validation comes back through the request (views.rerender), errors and all.
    bound = getattr(request, "degradation_forms", {})
    operator = has_role(request.user, OPERATOR)  # viewers get no forms, so none is built
    context = {"deployment": deployment, "policy": policy,
               "policy_form": operator and (bound.get("policy") or PolicyForm(deployment, policy=policy))}
    if policy is not None:
        now = timezone.now()
        state = state_document(deployment, policy)
        override = state["override"]
        context.update(
            state=state, override_expired=bool(override and override["until"] <= now),
            watched=[slo.name for slo in policy.slos.all()],
            actions=action_lines(state["actions"]),
            levels=[{"number": number, "name": level["name"], "enter": level["enter_burn_rate"],
                     "exit": level["exit_burn_rate"], "actions": action_lines(level.get("actions"))}
                    for number, level in enumerate(policy.levels, start=1)],
            timeline=[{**entry, "from_name": services.level_name(policy, entry["from"]),
                       "to_name": services.level_name(policy, entry["to"])} for entry in state["history"]],
            chart=chart_data(deployment, policy, state["level"], now),
            override_form=operator and (bound.get("override") or OverrideForm(policy)),
            quality=quality_shown(deployment, policy),
        )
    return render_to_string("degradation/_panel.html", context, request=request)


def quality_shown(deployment: Deployment, policy: DegradationPolicy) -> dict:
    """The fallbacks' scores as the panel reads them: percentages, and the lower fallback scores marked."""
    shown = quality_document(deployment, policy)
    for fallback in shown["fallbacks"]:
        for row in fallback["scores"]:
            theirs, own = row["fallback"], row["own"]
            row["lower"] = bool(theirs and own and theirs["score"] < own["score"])
            for side in (theirs, own):
                if side:
                    side["percent"] = percent(side["score"])
    return shown


def action_lines(actions: dict | None) -> list[str]:
    """A level's actions (or those in force) in words."""
    actions = actions or {}
    lines = []
    if actions.get("shed_below_priority") is not None:
        retry = f", Retry-After {actions['retry_after_s']} s" if actions.get("retry_after_s") else ""
        lines.append(f"requests below priority {actions['shed_below_priority']} get 503 degraded{retry}")
    if actions.get("max_tokens_cap"):
        lines.append(f"max_tokens capped at {actions['max_tokens_cap']}")
    if fallback := actions.get("fallback"):
        share = [f"{fallback['weight']}% of requests"] if fallback.get("weight") else []
        share += [f"priorities {', '.join(map(str, fallback['priorities']))}"] if fallback.get("priorities") else []
        lines.append(f"{' and '.join(share)} go to {fallback['deployment']}")
    if actions.get("scale_up"):
        lines.append(f"up to {actions['scale_up']} more replicas")
    if actions.get("freeze_rollouts"):
        lines.append("rollouts frozen: none starts, running canaries pause")
    return lines


def chart_span(policy: DegradationPolicy, now: datetime) -> tuple[datetime, datetime]:
    """From the policy's creation to now: at least CHART_SPAN_MIN, at most the last CHART_SPAN."""
    end = floor_minute(now)
    start = min(max(floor_minute(policy.created_at), end - CHART_SPAN), end - CHART_SPAN_MIN)
    return start, end


def chart_data(deployment: Deployment, policy: DegradationPolicy, level_now: int, now: datetime) -> dict:
    """The level as a step line over the chart's span, and each watched SLO's burn over the
    policy's window at every minute: what the engine saw (or would have, before an edit)."""
    start, end = chart_span(policy, now)
    moments = [start + index * MINUTE for index in range((end - start) // MINUTE + 1)]
    slos = watched_slos(policy)
    series = burn_rate_series(slos, policy.window_minutes, moments)
    # As in the engine, an SLO with too few requests in the window shows no burn (a gap).
    burn = {slo.name: [round(rates[slo.pk][0], 3) if rates[slo.pk][1] >= slo.min_requests else None
                       for rates in series] for slo in slos}
    changes = list(LevelChange.objects.filter(deployment=deployment, at__gte=start).order_by("at", "id"))
    first = changes[0].from_level if changes else level_now
    return {
        "times": moments, "burn": burn, "window": f"{policy.window_minutes}m",
        "level": {"x": [start, *(change.at for change in changes), now],
                  "y": [first, *(change.to_level for change in changes), level_now]},
        "level_names": [services.level_name(policy, number) for number in range(len(policy.levels) + 1)],
        "entry_rates": [{"name": level["name"], "rate": level["enter_burn_rate"]} for level in policy.levels],
    }
