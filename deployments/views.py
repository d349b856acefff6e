import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from deployments import rollouts, services
from deployments.api import (
    SERIES_UNITS,
    DeploymentCreateSerializer,
    DeploymentSerializer,
    DeploymentUpdateSerializer,
    deployment_queryset,
)
from deployments.choices import ACTIVE_ROLLOUT, Backend, DriverName, ReplicaState, RolloutStatus, Strategy
from deployments.drivers import driver_for
from deployments.models import Rollout
from deployments.panels import render_panels
from deployments.rollout_gate import gate
from deployments.rollout_series import rollout_series
from deployments.rollout_spec import DEFAULT_CANARY_STEPS
from inferops.api import Conflict
from inferops.forms import serializer_check
from inferops.panels import safe_next
from inferops.roles import require_operator
from registry.models import RegisteredModel
from runtime.gateway.contract import PREVIEW_SUFFIX

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


# The API's field names in service messages, as the form's labels say them.
FIELD_WORDS = {"min_replicas": "minimum replicas", "max_replicas": "maximum replicas", "gpu_count": "GPU count",
               "gpu_type": "GPU type", "engine_args": "engine arguments", "replicas": "replicas"}
RESOURCE_FIELDS = ("cpu", "memory", "gpu_type", "gpu_count")
# Errors on API fields the form asks for through another field.
FORM_FIELD = {"model": "version", "alias": "version", "engine_args": "engine_args"}
# The API fields a form field stands for: when the form refuses it, the API's checks skip those.
API_FIELDS = {"version": ("model", "version", "alias"), **{key: ("resources",) for key in RESOURCE_FIELDS}}


def readable(text: str) -> str:
    if re.match(r"\w+: ", text):  # "<engine key>: reason": the key as the engine spells it
        return text
    for field, words in FIELD_WORDS.items():
        text = re.sub(rf"\b{field}\b", words, text)
    return text[:1].upper() + text[1:]


def version_choices(models) -> list:
    """Per model, its versions (with the aliases on each), then its aliases: "<model>:<number>" pins a
    number, "<model>@<alias>" the version the alias names now."""
    groups = []
    for model in models:
        on_version: dict[int, list[str]] = {}
        for alias in model.aliases.all():
            on_version.setdefault(alias.version_id, []).append(alias.name)
        options = []
        for version in sorted(model.versions.all(), key=lambda v: -v.number):
            label = f"{model.name} v{version.number}"
            if version.pk in on_version:
                label += f" ({', '.join(sorted(on_version[version.pk]))})"
            if version.status != "ready":
                label += f" · {version.status}"
            options.append((f"{model.name}:{version.number}", label))
        options += [(f"{model.name}@{alias.name}", f"{model.name} @{alias.name} (now v{alias.version.number})")
                    for alias in sorted(model.aliases.all(), key=lambda a: a.name)]
        if options:
            groups.append((model.name, options))
    return groups


def parse_version_choice(value: str) -> tuple[str, int | None, str | None]:
    """(model name, version number or None, alias or None) of a version_choices value."""
    if "@" in value:
        model, alias = value.split("@", 1)
        return model, None, alias
    model, number = value.rsplit(":", 1)
    return model, int(number), None


def cpu_value(text: str):
    """Cores as a number when typed as one (2, 0.5), else the quantity as typed ("500m")."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class DeploymentFields(forms.Form):
    """The fields a deployment's create and edit forms share, in the API's names."""

    replicas = forms.IntegerField(min_value=0, max_value=256, initial=1)
    autoscale = forms.BooleanField(required=False, help_text="let the autoscaler move replicas between the bounds")
    min_replicas = forms.IntegerField(min_value=0, max_value=256, required=False, label="Minimum replicas",
                                      help_text="empty: the replicas")
    max_replicas = forms.IntegerField(min_value=0, max_value=256, required=False, label="Maximum replicas",
                                      help_text="empty: the replicas")
    cpu = forms.CharField(required=False, max_length=32, label="CPU", help_text='cores per replica: 2, 0.5 or "500m"')
    memory = forms.CharField(required=False, max_length=32, help_text='per replica, e.g. "16Gi"')
    gpu_type = forms.CharField(required=False, max_length=64, label="GPU type", help_text="e.g. nvidia-h100")
    gpu_count = forms.IntegerField(required=False, min_value=0, max_value=64, label="GPU count",
                                   help_text="GPUs per replica")
    engine_args = JSONObjectField(required=False, label="Engine arguments", help_text='e.g. {"max_num_seqs": 64}')
    SECTIONS = [("Model", ("name", "version", "backend", "driver")),
                ("Replicas", ("replicas", "autoscale", "min_replicas", "max_replicas", "paused")),
                ("Resources (per replica)", RESOURCE_FIELDS), ("Engine", ("engine_args",))]

    def sections(self) -> list[tuple[str, list]]:
        return [(title, [self[name] for name in names if name in self.fields]) for title, names in self.SECTIONS]

    def refused(self) -> set[str]:
        """The API fields behind the fields the form holds errors on."""
        return {api for field in self.errors for api in API_FIELDS.get(field, (field,))}

    def resources(self) -> dict | None:
        """The resources typed, in the API's shape; None when one of their fields was refused."""
        data = self.cleaned_data
        if any(key not in data for key in RESOURCE_FIELDS):
            return None
        found = {key: data[key].strip() if isinstance(data[key], str) else data[key] for key in RESOURCE_FIELDS}
        if found["cpu"]:
            found["cpu"] = cpu_value(found["cpu"])
        return {key: value for key, value in found.items() if value not in ("", None)}

    def add_api_errors(self, errors: dict) -> None:
        """Errors keyed by API field (the serializer's or the service's) beside the form's field, in words."""
        for key, texts in errors.items():
            for text in texts:
                text, field = str(text), FORM_FIELD.get(key, key)
                if key == "resources" and (match := re.match(r"(\w+): (.*)", text)) and match[1] in self.fields:
                    field, text = match[1], match[2]
                self.add_error(field if field in self.fields else None, readable(text))

    def write(self, call):
        """Run a service; its refusal goes beside the fields. Its result, or None when it refused."""
        try:
            return call()
        except ValidationError as exc:
            self.add_api_errors(exc.message_dict)
        except Conflict as exc:
            self.add_error("name" if "name" in self.fields else None, str(exc.detail))
        return None


class DeploymentForm(DeploymentFields):
    name = forms.CharField(max_length=63, help_text="the route clients call: lowercase letters, digits and dashes")
    version = forms.ChoiceField(label="Model version", help_text="an alias pins the version it names now")
    backend = forms.ChoiceField(choices=Backend.choices)
    driver = forms.ChoiceField(choices=DriverName.choices)
    field_order = ["name", "version", "backend", "driver"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["version"].choices = [("", "choose a version")] + version_choices(
            RegisteredModel.objects.prefetch_related("versions", "aliases__version").order_by("name"))

    def api_body(self) -> dict:
        """What the form read, in the API's names; a field it refused is left out."""
        data = self.cleaned_data
        body = {key: data[key] for key in ("backend", "driver", "replicas", "autoscale", "engine_args",
                                           "min_replicas", "max_replicas") if data.get(key) is not None}
        if "name" in data:
            body["name"] = data["name"].strip()
        if "version" in data:
            model, number, alias = parse_version_choice(data["version"])
            body.update({"model": model, "version": number} if number is not None else {"model": model, "alias": alias})
        if (resources := self.resources()) is not None:
            body["resources"] = resources
        return body

    def create(self, actor):
        """Every check in one pass (the form's, the API serializer's, the service's), each error beside
        its field; the deployment, written only when nothing was refused (else None)."""
        self.is_valid()
        data, errors = serializer_check(DeploymentCreateSerializer, self.api_body(), refused=self.refused())
        self.add_api_errors(errors)
        if self.errors:  # the service judges what was read, and writes nothing
            self.write(lambda: services.deployment_build(**data, refused=self.refused() | set(errors)))
            return None
        return self.write(lambda: services.deployment_create(actor=actor, **data))


class DeploymentEditForm(DeploymentFields):
    version = forms.ChoiceField(label="Model version")
    paused = forms.BooleanField(required=False, help_text="Pause reconciliation")
    field_order = ["version"]

    def __init__(self, deployment, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deployment = deployment
        self.fields["version"].choices = version_choices([deployment.model])

    def changes(self) -> dict:
        """What differs from the deployment, in the API's names (a PATCH body); a refused field is left out."""
        data, deployment, changes = self.cleaned_data, self.deployment, {}
        if "version" in data:
            _, number, alias = parse_version_choice(data["version"])
            changes = {"alias": alias} if alias else {"version": number} if number != deployment.version.number else {}
        for key in ("replicas", "autoscale", "paused", "engine_args", "min_replicas", "max_replicas"):
            if data.get(key) is not None and data[key] != getattr(deployment, key):
                changes[key] = data[key]
        if (resources := self.resources()) is not None and resources != deployment.resources:
            changes["resources"] = resources
        return changes

    def review(self) -> dict:
        """The changes as the API reads them, after every check in one pass (the form's, the API
        serializer's, the service's on a copy of the deployment), each error beside its field."""
        self.is_valid()
        data, errors = serializer_check(DeploymentUpdateSerializer, self.changes(), refused=self.refused())
        self.add_api_errors(errors)
        copy = deployment_queryset().get(pk=self.deployment.pk)  # the service sets the changes on it
        self.write(lambda: services.apply_changes(copy, **data, refused=self.refused() | set(errors)))
        return data


def edit_initial(deployment) -> dict:
    return {"version": f"{deployment.model.name}:{deployment.version.number}", "replicas": deployment.replicas,
            "autoscale": deployment.autoscale, "min_replicas": deployment.min_replicas,
            "max_replicas": deployment.max_replicas, "paused": deployment.paused,
            "engine_args": deployment.engine_args,
            **{key: deployment.resources.get(key, "") for key in RESOURCE_FIELDS}}


def value_text(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, dict):
        return ", ".join(f"{key}={item}" for key, item in value.items()) or "none"
    return str(value)


def change_rows(deployment, changes: dict) -> list[dict]:
    """The diff a person confirms: each field that changes, before → after."""
    rows = []
    if "version" in changes or "alias" in changes:
        target = (deployment.model.aliases.select_related("version").get(name=changes["alias"]).version.number
                  if "alias" in changes else changes["version"])
        rows.append({"field": "Model version", "before": f"v{deployment.version.number}",
                     "after": f"v{target}" + (f" (alias {changes['alias']})" if "alias" in changes else "")})
    labels = {"replicas": "Replicas", "autoscale": "Autoscaling", "paused": "Reconciliation paused",
              "min_replicas": "Minimum replicas", "max_replicas": "Maximum replicas",
              "engine_args": "Engine arguments", "resources": "Resources"}
    rows += [{"field": label, "before": value_text(getattr(deployment, key)), "after": value_text(changes[key])}
             for key, label in labels.items() if key in changes]
    return rows


def changes_token(deployment, changes: dict) -> str:
    """Names one diff of one state: a confirmation applies only the diff it was shown, and a
    deployment changed meanwhile (or a form edited after review) is shown its new diff."""
    state = {"changes": changes, "updated_at": deployment.updated_at.isoformat()}
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:32]


@never_cache  # it refreshes itself (partials/live.html): every fetch must reach the database
@login_required
def deployment_list(request):
    from deployments.overview import deployment_health

    rows = deployment_health()  # every deployment, by name
    return render(request, "deployments/list.html", {"rows": rows})


@login_required
def deployment_create(request):
    require_operator(request, "Changing deployments")
    form = DeploymentForm(request.POST or None)
    if request.method == "POST":
        if created := form.create(request.user):
            messages.success(request, f"Deployment {created.name} created: v{created.version.number} "
                                      f"on {created.replicas} replica(s).")
            return redirect("deployments:detail", name=created.name)
        return render(request, "deployments/form.html", {"form": form, "title": "New deployment"}, status=400)
    return render(request, "deployments/form.html", {"form": form, "title": "New deployment"})


@login_required
def deployment_edit(request, name: str):
    """Scale, change version, autoscaling, resources or engine arguments: the change is shown as a
    diff and applied once the person confirms that diff."""
    require_operator(request, "Changing deployments")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    form = DeploymentEditForm(deployment, request.POST or None, initial=edit_initial(deployment))
    context = {"form": form, "title": f"Change {name}", "deployment": deployment}
    if request.method != "POST":
        return render(request, "deployments/form.html", context)
    validated = form.review()
    if form.errors:
        return render(request, "deployments/form.html", context, status=400)
    changes = form.changes()
    if not changes:
        form.add_error(None, f"Nothing to change: every value is what {name} has now.")
        return render(request, "deployments/form.html", context, status=400)
    token = changes_token(deployment, changes)
    if request.POST.get("confirm") != token:
        return render(request, "deployments/form.html", {**context, "diff": change_rows(deployment, changes),
                                                         "diff_token": token})
    updated = form.write(lambda: services.deployment_update(deployment=deployment, actor=request.user,
                                                            **validated))
    if updated is None:
        return render(request, "deployments/form.html", context, status=400)
    messages.success(request, f"{name} changed: " + "; ".join(
        f"{row['field'].lower()} {row['before']} → {row['after']}" for row in change_rows(deployment, changes)) + ".")
    return redirect("deployments:detail", name=name)


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
        "rollouts": history, "active_rollout": active, "undo": undo_offer(deployment, active),
        "rollout_form": rollout_form or RolloutForm(deployment, prefix="rollout"),
        "panels": render_panels(request, deployment),
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
    holdback = forms.IntegerField(required=False, min_value=0, max_value=50, label="Holdback during the watch (%)",
                                  help_text="traffic kept on the current version after success, to compare with; "
                                            "empty = the default, 0 = none")

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
                  "override_reason": data["override_reason"].strip(), "holdback": data["holdback"]}
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


@dataclass(frozen=True)
class UndoOffer:
    """What the Undo button would do (see rollouts.rollout_undo): its words, and the rollout whose version
    the platform rejected when undo would bring that version back (the form then asks why)."""

    text: str
    rejected: Rollout | None = None


def undo_offer(deployment, active) -> UndoOffer | None:
    if active is not None:
        return UndoOffer(f"abort rollout {active.pk}")
    last = rollouts.undo_target(deployment)
    if last is None:
        return None
    rejected = rollouts.rejected_by_platform(last)
    if rejected is not None:
        return UndoOffer(f"redeploy v{rejected.candidate_version.number}, which the platform rolled back", rejected)
    return UndoOffer(f"roll back to v{last.stable_version.number}" + (
        " with its engine args" if last.stable_engine_args != last.candidate_engine_args else ""))


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
    def load(track: dict) -> str:
        figures = track.get("load") or {}
        rate, queue = figures.get("requests_per_s_per_replica"), figures.get("queue_depth")
        if rate is None:
            return "—"
        waiting = f", {number_text(queue)} waiting" if queue is not None else ""
        return f"{number_text(rate)} req/s per replica{waiting}"

    index = measurement.step_index
    return {"m": measurement, "step": index + 1,
            "step_text": step_text(steps[index])[1] if index < len(steps) else "",
            "candidate_requests": requests(measurement.candidate), "stable_requests": requests(measurement.stable),
            "candidate_load": load(measurement.candidate), "stable_load": load(measurement.stable),
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
    holding_back = rollout.holding_back(now) and rollouts.undo_target(rollout.deployment) == rollout
    candidate_share = candidate_share_now(rollout, holding_back)
    return render(request, "deployments/rollout.html", {
        "rollout": rollout, "deployment": rollout.deployment, "steps": steps, "final_state": final_state,
        "candidate_share": candidate_share, "stable_share": 100 - candidate_share, "measurements": measurements,
        "holding_back": holding_back,
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
