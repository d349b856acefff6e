import json
from datetime import datetime, timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from deployments import rollouts, services
from deployments.api import SERIES_UNITS, DeploymentSerializer, deployment_queryset
from deployments.choices import ACTIVE_ROLLOUT, Backend, RolloutStatus, Strategy
from deployments.models import Rollout
from deployments.rollout_series import rollout_series
from deployments.rollout_spec import DEFAULT_CANARY_STEPS
from inferops.api import Conflict
from inferops.roles import OPERATOR, has_role
from registry.models import RegisteredModel
from runtime.choices import ReplicaState
from runtime.drivers import driver_for
from runtime.gateway.state import PREVIEW_SUFFIX

CHARTS = [
    ("requests_per_s", "Requests/s"), ("output_tokens_per_s", "Output tokens/s"),
    ("ttft", "TTFT p50 / p95 / p99 (ms)"), ("itl_p95", "ITL p95 (ms)"),
    ("kv_cache_usage", "KV-cache usage"), ("queue_depth", "Queue depth"),
]


class JSONObjectField(forms.CharField):
    widget = forms.Textarea(attrs={"rows": 3, "cols": 50, "class": "mono"})

    def to_python(self, value):
        value = (value or "").strip()
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg}.") from None
        if not isinstance(parsed, dict):
            raise ValidationError('Must be a JSON object, e.g. {"max_num_seqs": 64}.')
        return parsed

    def prepare_value(self, value):
        return json.dumps(value) if isinstance(value, dict) else value


class DeploymentForm(forms.Form):
    name = forms.SlugField(max_length=63)
    model = forms.ModelChoiceField(RegisteredModel.objects.all(), to_field_name="name")
    version = forms.IntegerField(min_value=1, required=False, help_text="or an alias")
    alias = forms.SlugField(required=False)
    backend = forms.ChoiceField(choices=Backend.choices)
    replicas = forms.IntegerField(min_value=0, max_value=256, initial=1)
    engine_args = JSONObjectField(required=False, help_text='e.g. {"max_num_seqs": 64}')


class DeploymentEditForm(forms.Form):
    version = forms.IntegerField(min_value=1, required=False)
    replicas = forms.IntegerField(min_value=0, max_value=256)
    paused = forms.BooleanField(required=False, help_text="Pause reconciliation")
    engine_args = JSONObjectField(required=False)


def apply_service(form, call):
    """Run a service; put its validation errors on the form's fields. True when it succeeded."""
    try:
        return call()
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            form.add_error(field if field in form.fields else None, messages)
    except Conflict as exc:
        form.add_error("name" if "name" in form.fields else None, str(exc.detail))
    return None


def require_operator(request):
    if not has_role(request.user, OPERATOR):
        raise PermissionDenied("Changing deployments needs the operator role.")


@login_required
def deployment_list(request):
    deployments = deployment_queryset().order_by("name")
    rows = DeploymentSerializer(deployments, many=True).data
    return render(request, "deployments/list.html", {"rows": rows})


@login_required
def deployment_create(request):
    require_operator(request)
    form = DeploymentForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        created = apply_service(form, lambda: services.deployment_create(
            actor=request.user, name=data["name"], model=data["model"], version=data["version"],
            alias=data["alias"] or None, backend=data["backend"], replicas=data["replicas"],
            engine_args=data["engine_args"],
        ))
        if created:
            return redirect("deployments:detail", name=created.name)
    return render(request, "deployments/form.html", {"form": form, "title": "New deployment"})


@login_required
def deployment_edit(request, name: str):
    require_operator(request)
    deployment = get_object_or_404(deployment_queryset(), name=name)
    initial = {"version": deployment.version.number, "replicas": deployment.replicas,
               "paused": deployment.paused, "engine_args": deployment.engine_args}
    form = DeploymentEditForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        changes = {key: data[key] for key in ("replicas", "paused", "engine_args") if data[key] != initial[key]}
        version = data["version"] if data["version"] != initial["version"] else None
        updated = apply_service(form, lambda: services.deployment_update(
            deployment=deployment, actor=request.user, version=version, **changes))
        if updated:
            return redirect("deployments:detail", name=name)
    return render(request, "deployments/form.html", {"form": form, "title": f"Change {name}",
                                                     "deployment": deployment})


@login_required
def deployment_detail(request, name: str):
    return render_detail(request, get_object_or_404(deployment_queryset(), name=name))


def render_detail(request, deployment, *, rollout_form=None, status=200):
    show_all = request.GET.get("replicas") == "all"
    replicas = deployment.replica_set.select_related("version").order_by("-id")
    if not show_all:
        replicas = replicas.exclude(state=ReplicaState.STOPPED)
    driver = driver_for(deployment.driver)
    rows = [{"replica": r, "log": driver.log_tail(r, lines=20)} for r in replicas[:50]]
    history = list(deployment.rollouts.select_related("stable_version", "candidate_version").order_by("-id")[:20])
    active = next((r for r in history if r.status in ACTIVE_ROLLOUT), None)
    if active is None:  # older than the last 20: the constraint allows one
        active = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "summary": DeploymentSerializer(deployment).data, "replicas": rows,
        "show_all": show_all, "charts": CHARTS, "units": SERIES_UNITS,
        "range": request.GET.get("range", "1h"),
        "rollouts": history, "active_rollout": active, "undo": undo_text(deployment, active),
        "rollout_form": rollout_form or RolloutForm(deployment, prefix="rollout"),
    }, status=status)


# ---------------------------------------------------------------------------- rollouts


class OptionalJSONObjectField(JSONObjectField):
    """Empty means "not given" (None), unlike {}."""

    def to_python(self, value):
        return super().to_python(value) if (value or "").strip() else None


class JSONValueField(forms.CharField):
    """Any JSON value (the service says what shape it wants); empty is None."""

    widget = forms.Textarea(attrs={"rows": 4, "cols": 60, "class": "mono"})

    def to_python(self, value):
        value = (value or "").strip()
        if not value:
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg}.") from None

    def prepare_value(self, value):
        return value if isinstance(value, str) or value is None else json.dumps(value)


class RolloutForm(forms.Form):
    version = forms.TypedChoiceField(coerce=int, empty_value=None, required=False, label="Candidate version")
    engine_args = OptionalJSONObjectField(required=False, label="Candidate engine arguments",
                                          help_text="the whole set; empty = keep the current ones")
    strategy = forms.ChoiceField(choices=Strategy.choices, initial=Strategy.CANARY)
    steps = JSONValueField(required=False, initial=DEFAULT_CANARY_STEPS,
                           help_text='canary: set_weight / pause ("60s", {} = until promoted) / analysis ("2m")')
    scale_down_delay = forms.CharField(required=False, max_length=32, help_text='blue-green: e.g. "10m"')
    override_reason = forms.CharField(required=False, max_length=500, label="Budget override reason",
                                      help_text="only while an SLO's error budget is exhausted; audited")

    def __init__(self, deployment, *args, **kwargs):
        super().__init__(*args, **kwargs)
        aliases: dict[int, list[str]] = {}
        for alias in deployment.model.aliases.all():
            aliases.setdefault(alias.version_id, []).append(alias.name)
        choices = [("", f"v{deployment.version.number} (keep the current version)")]
        for version in deployment.model.versions.order_by("-number"):
            label = f"v{version.number}"
            if version.id in aliases:
                label += f" ({', '.join(sorted(aliases[version.id]))})"
            if version.status != "ready":
                label += f" · {version.status}"
            choices.append((version.number, label))
        self.fields["version"].choices = choices
        self.fields["engine_args"].initial = deployment.engine_args

    def service_kwargs(self) -> dict:
        data = self.cleaned_data
        kwargs = {"version": data["version"], "engine_args": data["engine_args"], "strategy": data["strategy"],
                  "override_reason": data["override_reason"].strip()}
        if data["strategy"] == Strategy.BLUE_GREEN:  # each strategy reads its own fields
            kwargs["scale_down_delay"] = data["scale_down_delay"].strip() or None
        else:
            kwargs["steps"] = data["steps"]
        return kwargs


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


def undo_text(deployment, active) -> str | None:
    """What the Undo button would do (see rollouts.rollout_undo), or None when there is nothing to undo."""
    if active is not None:
        return f"abort rollout {active.pk}"
    last = rollouts.undo_target(deployment)
    if last is None:
        return None
    return f"roll back to v{last.stable_version.number}" + (
        " with its engine args" if last.stable_engine_args != last.candidate_engine_args else "")


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
    index = measurement.step_index
    return {"m": measurement, "step": index + 1,
            "step_text": step_text(steps[index])[1] if index < len(steps) else "",
            "candidate_requests": requests(measurement.candidate), "stable_requests": requests(measurement.stable),
            "checks": checks}


def get_rollout(name: str, pk: int) -> Rollout:
    return get_object_or_404(
        Rollout.objects.select_related("deployment", "stable_version", "candidate_version", "created_by"),
        pk=pk, deployment__name=name)


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
    for index, step in enumerate(rollout.steps):
        kind, text = step_text(step)
        state = ("done" if index < rollout.step_index or rollout.status == RolloutStatus.SUCCEEDED
                 else "current" if index == rollout.step_index and rollout.active
                 else "stopped" if index == rollout.step_index and rollout.status == RolloutStatus.ABORTED else "")
        steps.append({"number": index + 1, "kind": kind, "text": text, "state": state})
    final_state = ("done" if rollout.status == RolloutStatus.SUCCEEDED
                   else "current" if rollout.active and rollout.step_index >= len(rollout.steps) else "")
    measurements = [measurement_row(m, rollout.steps) for m in rollout.measurements.order_by("-taken_at", "-id")[:200]]
    return render(request, "deployments/rollout.html", {
        "rollout": rollout, "deployment": rollout.deployment, "steps": steps, "final_state": final_state,
        "stable_weight": 100 - rollout.weight, "measurements": measurements,
        "preview_route": rollout.deployment.name + PREVIEW_SUFFIX,
        "timeline": [{**entry, "at": datetime.fromisoformat(entry["at"])} for entry in rollout.timeline],
        "chart_data": {"series": series, "timeline": rollout.timeline}, "chart_clipped": start > rollout.created_at,
    })


@login_required
@require_POST
def rollout_start(request, name: str):
    require_operator(request)
    deployment = get_object_or_404(deployment_queryset(), name=name)
    form = RolloutForm(deployment, request.POST, prefix="rollout")
    if form.is_valid():
        created = apply_service(form, lambda: rollouts.rollout_create(
            deployment=deployment, actor=request.user, **form.service_kwargs()))
        if created:
            messages.success(request, f"Rollout {created.pk} started: v{created.stable_version.number} → "
                                      f"v{created.candidate_version.number} ({created.strategy}).")
            return redirect("deployments:rollout", name=name, pk=created.pk)
    return render_detail(request, deployment, rollout_form=form, status=400)


ACTION_DONE = {
    "promote": "promoted to its next step", "promote-full": "promoted through every step",
    "abort": "aborted: traffic is back on the stable version", "retry": "started again from its first step",
}


@login_required
@require_POST
def rollout_action(request, name: str, pk: int, action: str):
    require_operator(request)
    rollout = get_rollout(name, pk)
    text = request.POST.get("reason" if action == "abort" else "override_reason", "").strip()
    if len(text) > 500:
        messages.error(request, "The reason is too long (at most 500 characters).")
        return redirect("deployments:rollout", name=name, pk=pk)
    user = request.user
    calls = {
        "promote": lambda: rollouts.rollout_promote(rollout=rollout, actor=user),
        "promote-full": lambda: rollouts.rollout_promote(rollout=rollout, actor=user, full=True),
        "abort": lambda: rollouts.rollout_abort(rollout=rollout, actor=user, reason=text),
        "retry": lambda: rollouts.rollout_retry(rollout=rollout, actor=user, override_reason=text),
    }
    if flash_errors(request, calls[action]):
        messages.success(request, f"Rollout {pk} {ACTION_DONE[action]}.")
    return redirect("deployments:rollout", name=name, pk=pk)


@login_required
@require_POST
def rollout_undo(request, name: str):
    require_operator(request)
    deployment = get_object_or_404(deployment_queryset(), name=name)
    result = flash_errors(request, lambda: rollouts.rollout_undo(deployment=deployment, actor=request.user))
    if result is None:
        return redirect("deployments:detail", name=name)
    if result.status == RolloutStatus.ABORTED:
        messages.success(request, f"Rollout {result.pk} aborted: traffic is back on v{result.stable_version.number}.")
    else:
        messages.success(request, f"Rolling back to v{result.candidate_version.number} (rollout {result.pk}).")
    return redirect("deployments:rollout", name=name, pk=result.pk)
