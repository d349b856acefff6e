import json

from django import forms
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect, render

from deployments import services
from deployments.api import SERIES_UNITS, DeploymentSerializer, deployment_queryset
from deployments.choices import Backend
from inferops.api import Conflict
from inferops.roles import OPERATOR, has_role
from registry.models import RegisteredModel
from runtime.choices import ReplicaState
from runtime.drivers import driver_for

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
    deployment = get_object_or_404(deployment_queryset(), name=name)
    show_all = request.GET.get("replicas") == "all"
    replicas = deployment.replica_set.select_related("version").order_by("-id")
    if not show_all:
        replicas = replicas.exclude(state=ReplicaState.STOPPED)
    driver = driver_for(deployment.driver)
    rows = [{"replica": r, "log": driver.log_tail(r, lines=20)} for r in replicas[:50]]
    return render(request, "deployments/detail.html", {
        "deployment": deployment, "summary": DeploymentSerializer(deployment).data, "replicas": rows,
        "show_all": show_all, "charts": CHARTS, "units": SERIES_UNITS,
        "range": request.GET.get("range", "1h"),
    })
