"""Console pages of silences: the list (active, pending, expired, each with the open alerts it
matches now) with an expire button, and a form to create one.

The form only reads what was typed (matchers one per line as in amtool: `name=value`,
`name=~regex`, `name!=value`, `name!~regex`); every check is the API's serializer, so the console
and `POST /api/v1/silences/` refuse the same silences with the same messages.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from alerts.choices import OPEN_STATUSES
from alerts.inbound import alertmanager as inbound
from alerts.matchers import OPERATORS, parse_lines
from alerts.models import Alert, Silence
from alerts.silences.api import STATES, SilenceCreateSerializer, silences_in_state
from inferops.api import Conflict
from inferops.console import console_action, tell_and_return
from inferops.roles import OPERATOR, require_operator
from inferops.timeparse import DURATION_HINT, parse_duration, parse_time

EXPIRED_SHOWN = 50
# Where the form's fields are in the serializer's errors.
API_FIELDS = {"matchers": "matchers", "startsAt": "starts", "endsAt": "ends", "comment": "comment"}


def parse_matchers(text: str) -> list[dict]:
    """amtool's matcher lines (alerts/matchers.py) as API v2 matchers; every bad line is named."""
    matchers = []
    for name, op, value in parse_lines(text):
        is_regex, is_equal = OPERATORS[op]
        matchers.append({"name": name, "value": value, "isRegex": is_regex, "isEqual": is_equal})
    if not matchers:
        raise ValidationError("Give at least one matcher, e.g. alertname=HighLatency.")
    return matchers


def matcher_text(matcher: dict) -> str:
    operator = {v: k for k, v in OPERATORS.items()}[(matcher["isRegex"], matcher.get("isEqual", True))]
    return f"{matcher['name']}{operator}{json.dumps(matcher['value'])}"


class SilenceForm(forms.Form):
    matchers = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 5, "cols": 60, "class": "mono", "spellcheck": "false"}),
        help_text='one per line: name=value, name!=value, name=~regex, name!~regex (a value may be quoted: '
                  'severity="page"; regexes match the whole value)')
    starts = forms.CharField(required=False, max_length=64, help_text="blank: now; or an ISO 8601 time (UTC)")
    ends = forms.CharField(initial="2h", max_length=64,
                           help_text='a duration from the start ("2h", "1d") or an ISO 8601 end time (UTC)')
    comment = forms.CharField(widget=forms.Textarea(attrs={"rows": 2, "cols": 60}), max_length=5000,
                              help_text="why, and who to ask")

    def clean_matchers(self) -> list[dict]:
        return parse_matchers(self.cleaned_data["matchers"])

    def clean_starts(self):
        value = self.cleaned_data["starts"].strip()
        if not value:
            return None
        try:
            return parse_time(value, "starts")
        except ValueError:
            raise ValidationError(f"{value!r} is not an ISO 8601 time.") from None

    def api_body(self, created_by: str) -> dict:
        data = self.cleaned_data
        starts_at = data["starts"] or timezone.now()
        text = data["ends"].strip()
        try:
            ends_at = starts_at + timedelta(seconds=parse_duration(text, "ends"))
        except ValueError:
            try:
                ends_at = parse_time(text, "ends")
            except ValueError:
                self.add_error("ends", f"{text!r} is neither {DURATION_HINT} nor an ISO 8601 time.")
                return {}
        return {"matchers": data["matchers"], "startsAt": starts_at.isoformat(), "endsAt": ends_at.isoformat(),
                "createdBy": created_by, "comment": data["comment"]}


def add_serializer_errors(form: forms.Form, errors: dict) -> None:
    for api_field, messages_ in errors.items():
        field = API_FIELDS.get(api_field)
        if isinstance(messages_, dict):  # matchers: {index: {field: [...]}}
            for index, detail in messages_.items():
                for name, texts in (detail.items() if isinstance(detail, dict) else [("", detail)]):
                    for text in texts:
                        form.add_error(field, f"Matcher {int(index) + 1}{' ' + name if name else ''}: {text}")
            continue
        for text in messages_:
            form.add_error(field, str(text))


@login_required
def silence_list(request):
    now = timezone.now()
    open_alerts = list(Alert.objects.filter(status__in=OPEN_STATUSES).order_by("-starts_at"))
    sections = []
    for state in STATES:
        silences = silences_in_state(state, now)
        if state == "expired":
            silences = silences[:EXPIRED_SHOWN]
        rows = [{"silence": s, "matchers": [matcher_text(m) for m in s.matchers],
                 "alerts": inbound.alerts_silenced_by(s, open_alerts) if state != "expired" else []}
                for s in silences]
        sections.append({"state": state, "rows": rows})
    return render(request, "alerts/silences.html", {"sections": sections, "now": now})


@login_required
def silence_new(request):
    require_operator(request, "Creating a silence")
    if request.method == "POST":
        form = SilenceForm(request.POST)
        if form.is_valid():
            body = form.api_body(created_by=request.user.username)
            if body:
                serializer = SilenceCreateSerializer(data=body)
                if serializer.is_valid():
                    silence = inbound.silence_create(**serializer.validated_data, actor=request.user)
                    messages.success(request, f"Silence {silence.pk} created, until "
                                              f"{silence.ends_at:%Y-%m-%d %H:%M} UTC.")
                    return redirect("alerts:silence-list")
                add_serializer_errors(form, serializer.errors)
        return render(request, "alerts/silences_new.html", {"form": form}, status=400)
    initial = {}
    if labels := request.GET.get("matchers"):  # "create a silence like this alert" links
        initial["matchers"] = labels
    return render(request, "alerts/silences_new.html", {"form": SilenceForm(initial=initial)})


@login_required
def silence_edit(request, pk: int):
    """The new-silence form, filled in; saving goes through the API's update rule."""
    require_operator(request, "Editing a silence")
    silence = get_object_or_404(Silence, pk=pk)
    now = timezone.now()
    if silence.ends_at <= now:
        messages.error(request, f"Silence {pk} has expired: create a new one instead.")
        return redirect("alerts:silence-list")
    context = {"silence": silence, "now": now}
    if request.method == "POST":
        form = SilenceForm(request.POST)
        if form.is_valid():
            body = form.api_body(created_by=request.user.username)
            if body:
                serializer = SilenceCreateSerializer(data={**body, "id": str(pk)})
                if serializer.is_valid():
                    fields = dict(serializer.validated_data)
                    try:
                        saved = inbound.silence_update(silence=fields.pop("id"), **fields, actor=request.user)
                    except Conflict as exc:
                        messages.error(request, str(exc.detail))
                        return redirect("alerts:silence-list")
                    messages.success(request, f"Silence {pk} saved." if saved.pk == pk else
                                     f"Silence {pk} expired and replaced by silence {saved.pk} (new matchers).")
                    return redirect("alerts:silence-list")
                add_serializer_errors(form, serializer.errors)
        return render(request, "alerts/silences_new.html", {**context, "form": form}, status=400)
    initial = {"matchers": "\n".join(matcher_text(m) for m in silence.matchers), "comment": silence.comment,
               "starts": "" if silence.starts_at <= now else silence.starts_at.isoformat(),
               "ends": silence.ends_at.isoformat()}
    return render(request, "alerts/silences_new.html", {**context, "form": SilenceForm(initial=initial)})


@console_action(OPERATOR, "Expiring a silence")
def silence_expire(request, pk: int):
    silence = get_object_or_404(Silence, pk=pk)
    return tell_and_return(request, lambda: inbound.silence_expire(silence=silence, actor=request.user),
                           f"Silence {pk} expired: the alerts it muted notify at the next sweep.",
                           "alerts:silence-list")
