"""Console form of a deployment's autoscaling policy, on the deployment page.

The form only carries what the operator typed; the REST API's serializer judges it, so the
console and the API refuse the same policies with the same messages.
"""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from capacity.autoscaler import SIGNALS
from capacity.policy import SIGNAL_TARGETS, AutoscalingPolicySerializer, document, policy_context
from capacity.scaling import policy_save
from deployments.api import deployment_queryset
from deployments.views import render_detail
from inferops.forms import add_api_errors, serializer_check
from inferops.roles import require_operator

NUMBER = {"step": "any"}


def _number(label: str, help_text: str = "", integer: bool = False) -> forms.Field:
    field = forms.IntegerField if integer else forms.FloatField
    return field(required=False, label=label, help_text=help_text,
                 widget=forms.NumberInput(attrs={} if integer else NUMBER))


class PolicyForm(forms.Form):
    enabled = forms.BooleanField(required=False, help_text="off: the replica count stays where it is")
    min_replicas = _number("Minimum replicas", "0 lets it park when idle", integer=True)
    max_replicas = _number("Maximum replicas", integer=True)
    up_step = _number("Scale up: step", "replicas added at most per change", integer=True)
    up_stabilization_s = _number("Scale up: stabilisation (s)", "the load must ask for it this long")
    down_step = _number("Scale down: step", integer=True)
    down_stabilization_s = _number("Scale down: stabilisation (s)")
    cooldown_s = _number("Cooldown (s)", "no change within this long of the last")
    park_after_s = _number("Park after idle (s)", "with minimum 0")
    hold_max_wait_s = _number("Hold: longest wait (s)", "a request held for a parked deployment")
    hold_max_queue = _number("Hold: most requests held", "per gateway", integer=True)

    def __init__(self, deployment, *args, **kwargs):
        doc = document(deployment)
        kwargs.setdefault("initial", {
            "enabled": doc["enabled"], "min_replicas": doc["min_replicas"], "max_replicas": doc["max_replicas"],
            "up_step": doc["scale_up"]["step"], "up_stabilization_s": doc["scale_up"]["stabilization_s"],
            "down_step": doc["scale_down"]["step"], "down_stabilization_s": doc["scale_down"]["stabilization_s"],
            "cooldown_s": doc["cooldown_s"], "park_after_s": doc["park_after_s"],
            "hold_max_wait_s": doc["hold"]["max_wait_s"], "hold_max_queue": doc["hold"]["max_queue"],
            **{f"signal_{name}": target for name, target in doc["signals"].items()}})
        super().__init__(*args, prefix="autoscaling", **kwargs)
        for name in SIGNALS:  # one box per signal: a target, or empty for a signal not used
            self.fields[f"signal_{name}"] = _number(f"Signal {name}", SIGNAL_TARGETS[name][0])

    def api_body(self) -> dict:
        data = self.cleaned_data
        """What the form read, as the API takes it; an empty box is left out (the default holds)."""
        data = self.cleaned_data
        body = {key: data.get(key) for key in ("enabled", "min_replicas", "max_replicas", "cooldown_s", "park_after_s")}
        body["signals"] = {name: data.get(f"signal_{name}") for name in SIGNALS}
        body["scale_up"] = {"step": data.get("up_step"), "stabilization_s": data.get("up_stabilization_s")}
        body["scale_down"] = {"step": data.get("down_step"), "stabilization_s": data.get("down_stabilization_s")}
        body["hold"] = {"max_wait_s": data.get("hold_max_wait_s"), "max_queue": data.get("hold_max_queue")}
        return _given(body) | {"signals": _given(body["signals"])}


def _given(values: dict) -> dict:
    return {key: _given(value) if isinstance(value, dict) else value for key, value in values.items()
            if value is not None}


@login_required
@require_POST
def policy_edit(request, name: str):
    require_operator(request, "Changing autoscaling")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    form = PolicyForm(deployment, request.POST)
    form.is_valid()
    data, errors = serializer_check(AutoscalingPolicySerializer, form.api_body(), refused=set(form.errors),
                                    context=policy_context(deployment))
    add_api_errors(form, errors)
    if form.errors:
        request.autoscaling_form = form  # the panel shows it, errors and all
        return render_detail(request, deployment, status=400)
    saved = policy_save(deployment=deployment, actor=request.user, data=data)
    state = "on" if saved.autoscale else "off"
    messages.success(request, f"Autoscaling of {name} saved ({state}): {saved.min_replicas} to "
                              f"{saved.max_replicas} replicas on {', '.join(data['signals'])}.")
    return redirect(reverse("deployments:detail", args=[name]) + "#autoscaling")
