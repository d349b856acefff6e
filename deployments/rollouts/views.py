"""The rollout pages of the console: start, follow, promote, abort, retry, undo."""

from datetime import datetime, timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from deployments.api import (
    deployment_queryset,
)
from deployments.choices import RolloutStatus
from deployments.models import Rollout
from deployments.rollouts import services as rollouts
from deployments.rollouts.forms import RolloutForm
from deployments.rollouts.gate import gate
from deployments.rollouts.quality import limits_text, quality_looks
from deployments.rollouts.series import rollout_series
from deployments.views import render_detail
from inferops.api import Conflict
from inferops.panels import safe_next
from inferops.roles import require_operator
from runtime.gateway.contract import PREVIEW_SUFFIX


def error_text(exc: Exception) -> str:
    if isinstance(exc, Conflict):
        return str(exc.detail)
    if hasattr(exc, "error_dict"):
        return " ".join(f"{field}: {' '.join(errors)}" for field, errors in exc.message_dict.items())
    return " ".join(exc.messages)


def flash_errors(request, call):
    """Run a service; its refusal (409, 400) becomes an error message on the next page. None then."""
    try:
        return call()
    except (ValidationError, Conflict) as exc:
        messages.error(request, error_text(exc))
    return None


def duration_text(seconds: float) -> str:
    seconds = float(seconds)
    hours, rest = divmod(int(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    secs += seconds - int(seconds)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "") + (f"{secs:g}s" if secs else "")
    return text or "0s"


CHART_SPAN_MAX = timedelta(hours=6)
THRESHOLD_TEXT = {"ttft_p95_ratio": "TTFT p95 ≤ {:g}× stable", "tpot_p95_ratio": "TPOT p95 ≤ {:g}× stable",
                  "e2e_p95_ratio": "E2E p95 ≤ {:g}× stable", "error_rate_max": "error rate ≤ {:g}"}


def step_text(step: dict) -> tuple[str, str]:
    """(kind, description) of a normalised step."""
    if "set_weight" in step:
        return "set_weight", f"set weight {step['set_weight']}%"
    if "pause" in step:
        seconds = step["pause"]
        return "pause", "pause until promoted" if seconds is None else f"pause {duration_text(seconds)}"
    if "quality" in step:
        config = step["quality"]
        version = f" v{config['set_version']}" if config.get("set_version") else ""
        return "quality", (f"quality {config['eval_set']}{version}: {limits_text(config)} "
                           f"(timeout {duration_text(config['timeout'])})")
    config = step["analysis"]
    details = [f"min {config['min_requests']} requests", f"burn rate ≤ {config['max_burn_rate']:g}×"]
    details += [THRESHOLD_TEXT[name].format(limit) for name, limit in config.get("thresholds", {}).items()]
    return "analysis", f"analysis {duration_text(config['duration'])} ({', '.join(details)})"


def number_text(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"
    return str(value)


def measurement_row(measurement, steps: list) -> dict:
    def requests(track: dict) -> int:
        return (track.get("requests") or 0) + (track.get("failed_attempts") or 0)

    checks = [{"name": check["name"], "candidate": number_text(check.get("candidate")),
               "stable": number_text(check.get("stable")), "limit": number_text(check.get("limit")),
               "ok": {True: "ok", False: "fail"}.get(check.get("ok"), "not judged")}
              for check in measurement.checks]
    def load(track: dict) -> str:
        figures = track.get("load") or {}
        rate, queue = figures.get("requests_per_s_per_replica"), figures.get("queue_depth")
        if rate is None:
            return "—"
        waiting = f", {number_text(queue)} waiting" if queue is not None else ""
        return f"{number_text(rate)} req/s per replica{waiting}"

    index = measurement.step_index
    scored = index < len(steps) and "quality" in steps[index]  # eval runs, not traffic: no requests or load
    return {"m": measurement, "step": index + 1,
            "step_text": step_text(steps[index])[1] if index < len(steps) else "",
            "candidate_requests": "—" if scored else requests(measurement.candidate),
            "stable_requests": "—" if scored else requests(measurement.stable),
            "candidate_load": "—" if scored else load(measurement.candidate),
            "stable_load": "—" if scored else load(measurement.stable),
            "baseline": measurement.stable.get("baseline", ""), "checks": checks}


def get_rollout(name: str, pk: int) -> Rollout:
    return get_object_or_404(
        Rollout.objects.select_related("deployment", "stable_version", "candidate_version", "created_by"),
        pk=pk, deployment__name=name)


def candidate_share_now(rollout: Rollout, holding_back: bool) -> int:
    """Percent of traffic on the candidate now: its weight while the rollout runs; once it is over, all
    of it after a promotion (less a holdback kept on stable during the watch), none after an abort or
    a rollback."""
    if rollout.active:
        return rollout.weight
    if rollout.status == RolloutStatus.SUCCEEDED:
        return 100 - rollout.holdback_percent if holding_back else 100
    return 0


@login_required
def rollout_detail(request, name: str, pk: int):
    rollout = get_rollout(name, pk)
    now = timezone.now()
    # Through the return to stable (or the switch) and a minute after it, or until now.
    end = min(now, rollout.finished_at + timedelta(seconds=60)) if rollout.finished_at else now
    end = max(end, rollout.created_at)
    # A rollout left paused for days is charted over its last hours: the page reloads every 5 s.
    start = max(rollout.created_at, end - CHART_SPAN_MAX)
    series = rollout_series(rollout, start, end)
    steps = []
    completed = rollout.status in (RolloutStatus.SUCCEEDED, RolloutStatus.ROLLED_BACK)  # rolled back after success
    for index, step in enumerate(rollout.steps):
        kind, text = step_text(step)
        state = ("done" if index < rollout.step_index or completed
                 else "current" if index == rollout.step_index and rollout.active
                 else "stopped" if index == rollout.step_index and rollout.status == RolloutStatus.ABORTED else "")
        steps.append({"number": index + 1, "kind": kind, "text": text, "state": state})
    final_state = ("done" if completed
                   else "current" if rollout.active and rollout.step_index >= len(rollout.steps) else "")
    measurements = [measurement_row(m, rollout.steps) for m in rollout.measurements.order_by("-taken_at", "-id")[:200]]
    quality = [{**look, "step_text": step_text(rollout.steps[look["step_index"]])[1],
                "current": look["attempt"] == rollout.attempt}
               for look in reversed(quality_looks(rollout))]  # latest attempt first
    holding_back = rollout.holding_back(now) and rollouts.undo_target(rollout.deployment) == rollout
    candidate_share = candidate_share_now(rollout, holding_back)
    return render(request, "deployments/rollout.html", {
        "rollout": rollout, "deployment": rollout.deployment, "steps": steps, "final_state": final_state,
        "candidate_share": candidate_share, "stable_share": 100 - candidate_share, "measurements": measurements,
        "holding_back": holding_back, "quality": quality,
        "preview_route": rollout.deployment.name + PREVIEW_SUFFIX,
        "timeline": [{**entry, "at": datetime.fromisoformat(entry["at"])} for entry in rollout.timeline],
        "chart_data": {"series": series, "timeline": rollout.timeline}, "chart_clipped": start > rollout.created_at,
    })


@login_required
@require_POST
def rollout_start(request, name: str):
    require_operator(request, "Changing deployments")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    form = RolloutForm(deployment, request.POST, prefix="rollout")
    if form.is_valid():
        kwargs = form.service_kwargs()
        try:
            created = rollouts.rollout_create(deployment=deployment, actor=request.user, **kwargs)
        except ValidationError as exc:
            for field, texts in exc.message_dict.items():
                form.add_error(field if field in form.fields else None, texts)
        except Conflict as exc:
            exhausted = gate().exhausted_slos(deployment) if not kwargs["override_reason"] else []
            if exhausted and str(exc.detail).startswith("Error budget exhausted"):
                offer_budget_override(form, deployment, exhausted)
            else:
                form.add_error(None, str(exc.detail))
        else:
            messages.success(request, f"Rollout {created.pk} started: v{created.stable_version.number} → "
                                      f"v{created.candidate_version.number} ({created.strategy}).")
            return redirect("deployments:rollout", name=name, pk=created.pk)
    return render_detail(request, deployment, rollout_form=form, status=400)


def offer_budget_override(form: RolloutForm, deployment, exhausted: list[tuple[str, float]]) -> None:
    """A refusal by the error-budget policy, in words, with the override it allows: the same form
    again, with a reason that is recorded on the rollout and in the audit log."""
    form.budget_refusal = {
        "slos": [{"name": slo, "over": f"{-remaining:.0%}"} for slo, remaining in exhausted],
        "deployment": deployment.name,
    }
    form.add_error("override_reason", "Say why this rollout should go ahead while the budget is spent, "
                                      "or wait until it recovers.")


ACTION_DONE = {
    "promote": "promoted to its next step", "promote-full": "promoted through every step",
    "abort": "aborted: traffic is back on the stable version", "retry": "started again from its first step",
    "auto-rollback-on": "will be rolled back by the platform if it burns an SLO during its watch",
    "auto-rollback-off": "will not be rolled back by the platform during its watch",
}


@login_required
@require_POST
def rollout_action(request, name: str, pk: int, action: str):
    require_operator(request, "Changing deployments")
    rollout = get_rollout(name, pk)
    back = safe_next(request) or reverse("deployments:rollout", args=[name, pk])  # e.g. an alert's page
    text = request.POST.get("override_reason" if action == "retry" else "reason", "").strip()
    if len(text) > 500:
        messages.error(request, "The reason is too long (at most 500 characters).")
        return redirect(back)
    user = request.user
    calls = {
        "promote": lambda: rollouts.rollout_promote(rollout=rollout, actor=user, reason=text),
        "promote-full": lambda: rollouts.rollout_promote(rollout=rollout, actor=user, full=True, reason=text),
        "abort": lambda: rollouts.rollout_abort(rollout=rollout, actor=user, reason=text),
        "retry": lambda: rollouts.rollout_retry(rollout=rollout, actor=user, override_reason=text),
        "auto-rollback-on": lambda: rollouts.rollout_set_auto_rollback(rollout=rollout, actor=user, auto_rollback=True),
        "auto-rollback-off": lambda: rollouts.rollout_set_auto_rollback(rollout=rollout, actor=user,
                                                                        auto_rollback=False),
    }
    if flash_errors(request, calls[action]):
        messages.success(request, f"Rollout {pk} {ACTION_DONE[action]}.")
    return redirect(back)


@login_required
@require_POST
def rollout_undo(request, name: str):
    require_operator(request, "Changing deployments")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    back = safe_next(request)  # the page the form sat on (an alert's), else the deployment's or the rollout's
    reason, override_reason = (request.POST.get(field, "").strip() for field in ("reason", "override_reason"))
    if len(reason) > 500 or len(override_reason) > 500:
        messages.error(request, "The reason is too long (at most 500 characters).")
        return redirect(back or reverse("deployments:detail", args=[name]))
    result = flash_errors(request, lambda: rollouts.rollout_undo(
        deployment=deployment, actor=request.user, reason=reason, override_reason=override_reason))
    if result is None:
        return redirect(back or reverse("deployments:detail", args=[name]))
    if result.status == RolloutStatus.ABORTED:
        messages.success(request, f"Rollout {result.pk} aborted: traffic is back on v{result.stable_version.number}.")
    elif not result.rollback:
        messages.success(request, f"Redeploying v{result.candidate_version.number}, which the platform had rolled "
                                  f"back (rollout {result.pk}, {result.strategy}).")
    else:
        messages.success(request, f"Rolling back to v{result.candidate_version.number} (rollout {result.pk}).")
    return redirect(back or reverse("deployments:rollout", args=[name, result.pk]))
