"""Console forms of a deployment's degradation: edit the policy, force a level for a time, clear it.

The forms only carry what the operator typed: every check is the REST API's serializer, so the
console and the API refuse the same policies with the same messages.
"""

from __future__ import annotations

import json

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.views.decorators.http import require_POST

from degradation import services
from degradation.api import (
    ClearSerializer,
    OverrideSerializer,
    PolicySerializer,
    policy_save_validated,
    quality_document,
)
from degradation.engine import covering_slos
from degradation.models import DegradationPolicy
from deployments.api import deployment_queryset
from deployments.views import render_detail
from inferops.api import Conflict
from inferops.forms import add_api_errors, serializer_check
from inferops.panels import safe_next
from inferops.roles import require_operator

# What the levels box holds before a first policy: one gentle level, then a harder one.
EXAMPLE_LEVELS = [
    {"name": "shed-batch", "enter_burn_rate": 5, "exit_burn_rate": 2, "actions": {"shed_below_priority": 5}},
    {"name": "short-answers", "enter_burn_rate": 20, "exit_burn_rate": 10,
     "actions": {"shed_below_priority": 5, "max_tokens_cap": 256, "freeze_rollouts": True}},
]
LEVELS_HELP = ('JSON, level 1 first: [{"name", "enter_burn_rate", "exit_burn_rate", "actions": '
               '{"shed_below_priority", "max_tokens_cap", "fallback": {"deployment", "weight", "priorities"}, '
               '"scale_up", "freeze_rollouts"}}]')


class JSONListField(forms.CharField):
    """The levels box: any JSON the serializer can judge; only unreadable text is refused here."""

    widget = forms.Textarea(attrs={"rows": 12, "cols": 90, "class": "mono", "spellcheck": "false"})

    def to_python(self, value):
        if not (value or "").strip():
            raise ValidationError("Give the levels: a JSON list, level 1 first (the help below shows the shape).")
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValidationError(f"Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).") from None

    def prepare_value(self, value):
        if value is None or isinstance(value, str):  # None: a form posted without the box, shown empty
            return value
        return json.dumps(readable_levels(value), indent=2)


def readable_levels(levels: list[dict]) -> list[dict]:
    """Levels with their keys in the documented order (Postgres' jsonb keeps them by length)."""
    order = ("name", "enter_burn_rate", "exit_burn_rate", "actions")
    return [{**{key: level[key] for key in order if key in level}, **level} for level in levels]


class SloChoiceField(forms.MultipleChoiceField):
    def valid_value(self, value) -> bool:
        return True  # the serializer names an unknown SLO and lists the known ones


class PolicyForm(forms.Form):
    enabled = forms.BooleanField(required=False, initial=True, help_text="off: the deployment stays at level 0")
    window = forms.CharField(required=False, initial="5m", max_length=16,
                             help_text="burn-rate window: whole minutes from 1m to 1h")
    hold_s = forms.CharField(required=False, initial="60", label="Hold (s)", widget=forms.NumberInput,
                             help_text="a level is held at least this long, either way")
    slos = SloChoiceField(required=False, label="Watched SLOs", widget=forms.CheckboxSelectMultiple,
                                     help_text="none ticked: every SLO covering the deployment")
    levels = JSONListField(required=False, initial=EXAMPLE_LEVELS, help_text=LEVELS_HELP)  # [] is the serializer's

    def __init__(self, deployment, *args, policy: DegradationPolicy | None = None, **kwargs):
        if policy is not None:
            kwargs["initial"] = {"enabled": policy.enabled, "window": f"{policy.window_minutes}m",
                                 "hold_s": policy.hold_s, "slos": [slo.name for slo in policy.slos.all()],
                                 "levels": policy.levels}
        super().__init__(*args, prefix="policy", **kwargs)
        names = covering_slos(deployment).order_by("name").values_list("name", flat=True)
        self.fields["slos"].choices = [(name, name) for name in names]

    def api_body(self) -> dict:
        """What the form read; a field it refused (levels that are not JSON) is left out."""
        return {key: self.cleaned_data[key] for key in ("enabled", "window", "hold_s", "slos", "levels")
                if key in self.cleaned_data}


class OverrideForm(forms.Form):
    # Plain text behind a select: the serializer judges the level against the policy.
    level = forms.CharField(required=False, widget=forms.Select, help_text="0 turns degradation off")
    until = forms.CharField(required=False, initial="30m", max_length=64,
                            help_text='a duration from now ("30m", "2h") or an ISO 8601 time (UTC)')
    reason = forms.CharField(required=False, max_length=2000, help_text="recorded with the change and audited")

    def __init__(self, policy: DegradationPolicy, *args, **kwargs):
        super().__init__(*args, prefix="override", **kwargs)
        self.fields["level"].widget.choices = [("0", "0 · off (degradation disabled)")] + [
            (str(number), f"{number} · {level['name']}") for number, level in enumerate(policy.levels, start=1)]
        self.fields["level"].initial = "1"

    def api_body(self) -> dict:
        return self.cleaned_data


def console_url(name: str) -> str:
    return reverse("deployments:detail", args=[name]) + "#degradation"


def submit(request, deployment, form: forms.Form, serializer_class, context: dict, apply) -> HttpResponse:
    """What the operator typed, judged by the API's serializer; `apply(validated data)` writes and
    says what it did. On any error: the deployment page again, this form showing its errors; a form
    posted from another page (an alert's, its `next`) goes back there with the errors as a message."""
    back = safe_next(request)
    form.is_valid()  # the serializer judges every field the form could read, in the same pass
    data, errors = serializer_check(serializer_class, form.api_body(), refused=set(form.errors), context=context)
    add_api_errors(form, errors)
    if not form.errors:
        messages.success(request, apply(data))
        return redirect(back or console_url(deployment.name))
    if back:
        messages.error(request, " ".join(f"{field}: {' '.join(errors)}" if field != "__all__" else " ".join(errors)
                                         for field, errors in form.errors.items()))
        return redirect(back)
    request.degradation_forms = {form.prefix: form}  # the panel shows it instead of a fresh one
    return render_detail(request, deployment, status=400)


@login_required
@require_POST
def policy_edit(request, name: str):
    require_operator(request, "Changing degradation")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    policy = DegradationPolicy.objects.filter(deployment=deployment).first()

    def save(data: dict) -> str:
        saved = policy_save_validated(deployment=deployment, actor=request.user, data=data)
        for warning in quality_document(deployment, saved)["warnings"]:
            messages.warning(request, warning)  # saved all the same: degrading may mean answering worse
        state = "" if data["enabled"] else " (disabled)"
        return (f"Degradation policy of {name} saved{state}: {len(data['levels'])} level(s), "
                f"window {data['window']}m, hold {data['hold_s']} s.")

    return submit(request, deployment, PolicyForm(deployment, request.POST, policy=policy), PolicySerializer,
                  {"deployment": deployment}, save)


@login_required
@require_POST
def override_set(request, name: str):
    require_operator(request, "Changing degradation")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    policy = get_object_or_404(DegradationPolicy, deployment=deployment)

    def force(data: dict) -> str:
        services.override_set(deployment=deployment, actor=request.user, **data)
        held = "degradation off" if data["level"] == 0 else (
            f"held at level {data['level']} ({services.level_name(policy, data['level'])})")
        return f"{name}: {held} until {data['until']:%Y-%m-%d %H:%M} UTC."

    return submit(request, deployment, OverrideForm(policy, request.POST), OverrideSerializer, {"policy": policy},
                  force)


@login_required
@require_POST
def override_clear(request, name: str):
    require_operator(request, "Changing degradation")
    deployment = get_object_or_404(deployment_queryset(), name=name)
    serializer = ClearSerializer(data={"reason": request.POST.get("reason", "")})
    if not serializer.is_valid():
        messages.error(request, "The reason is too long: at most 2000 characters.")
        return redirect(console_url(name))
    try:
        services.override_clear(deployment=deployment, actor=request.user, reason=serializer.validated_data["reason"])
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    else:
        messages.success(request, f"Override of {name} cleared: the policy decides again at the next evaluation cycle.")
    return redirect(console_url(name))
