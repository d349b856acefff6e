"""Console pages of on-call schedules: the list (who is on call now and next), one schedule's page
(now and next, a 14-day timeline, its layers, its overrides with a form to add one), and a form
to create or edit a schedule. Times typed in a form are wall-clock times in the schedule's zone.

Every check is alerts.schedules.services' (the API's too): the forms only read what was typed.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from alerts.choices import Rotation
from alerts.models import Schedule, ScheduleOverride
from alerts.schedules import services as schedules
from inferops.api import Conflict
from inferops.console import console_action, tell_outcome
from inferops.roles import OPERATOR, require_operator

TIMELINE_DAYS = 14
LOCAL_INPUT = forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M")


def local_time(value: datetime | None, zone) -> datetime | None:
    """A time typed without an offset means the schedule's wall clock."""
    if value is None:
        return None
    return value.replace(tzinfo=zone) if timezone.is_naive(value) else value


class LocalDateTimeField(forms.DateTimeField):
    """Read naive: Django would otherwise make it aware in the server's zone, not the schedule's."""

    def to_python(self, value):
        parsed = super().to_python(value)
        return parsed.replace(tzinfo=None) if parsed is not None else None


def local_label(moment: datetime, zone) -> str:
    return f"{moment.astimezone(zone):%a %d %b %H:%M %Z}"


def usernames() -> list[str]:
    return list(get_user_model().objects.filter(is_active=True).order_by("username").values_list("username", flat=True))


class OverrideForm(forms.Form):
    user = forms.CharField(max_length=150)
    starts = LocalDateTimeField(widget=LOCAL_INPUT, help_text="local time in the schedule's zone")
    ends = LocalDateTimeField(widget=LOCAL_INPUT)
    reason = forms.CharField(max_length=200, required=False)


class ScheduleForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="lowercase letters, digits and dashes")
    time_zone = forms.CharField(max_length=64, initial="UTC", help_text="hand-offs happen at local time here, "
                                                                         "e.g. Europe/Berlin")
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "cols": 60}))


class LayerForm(forms.Form):
    name = forms.CharField(max_length=63, required=False)
    rotation = forms.ChoiceField(choices=Rotation.choices, initial=Rotation.WEEKLY)
    starts = LocalDateTimeField(widget=LOCAL_INPUT, help_text="the first hand-off, local time")
    ends = LocalDateTimeField(widget=LOCAL_INPUT, required=False)
    users = forms.CharField(max_length=2000, help_text="usernames in rotation order, comma-separated")


LayerFormSet = forms.formset_factory(LayerForm, extra=1, can_delete=True)


def add_validation_errors(form: forms.Form, error: ValidationError, fields: dict[str, str]) -> None:
    for field, texts in error.message_dict.items():
        for text in texts:
            form.add_error(fields.get(field), text)


def layer_initial(schedule: Schedule) -> list[dict]:
    zone = schedules.time_zone(schedule.time_zone)
    return [{"name": layer.name, "rotation": layer.rotation,
             "starts": layer.starts_at.astimezone(zone).replace(tzinfo=None),
             "ends": layer.ends_at.astimezone(zone).replace(tzinfo=None) if layer.ends_at else None,
             "users": ", ".join(m.user.username for m in layer.members.select_related("user"))}
            for layer in schedule.layers.all()]


def summaries(schedule_list, now: datetime) -> list[dict]:
    return [{"schedule": schedule, **schedules.on_call_summary(schedule, now)} for schedule in schedule_list]


@login_required
def schedule_list(request):
    now = timezone.now()
    return render(request, "alerts/schedules.html", {"rows": summaries(Schedule.objects.all(), now), "now": now})


@login_required
def schedule_detail(request, name: str, override_form: OverrideForm | None = None, status: int = 200):
    schedule = get_object_or_404(Schedule, name=name)
    now = timezone.now()
    zone = schedules.time_zone(schedule.time_zone)
    end = now + timedelta(days=TIMELINE_DAYS)
    timeline = schedules.shifts(schedule, now, end)
    chart = {"now": now.isoformat(), "end": end.isoformat(), "shifts": [
        {"user": piece["user"].username, "start": piece["starts_at"].isoformat(), "end": piece["ends_at"].isoformat(),
         "source": piece["source"], "label": f"{local_label(piece['starts_at'], zone)} – "
                                             f"{local_label(piece['ends_at'], zone)}"}
        for piece in timeline]}
    if override_form is None:
        start = now.astimezone(zone).replace(tzinfo=None, second=0, microsecond=0)
        override_form = OverrideForm(initial={"starts": start, "ends": start + timedelta(hours=8)})
    return render(request, "alerts/schedule_detail.html", {
        "schedule": schedule, **schedules.on_call_summary(schedule, now), "chart": chart, "timeline": timeline,
        "layers": schedule.layers.prefetch_related("members__user"),
        "overrides": schedule.overrides.filter(ends_at__gt=now).select_related("user", "created_by"),
        "override_form": override_form, "usernames": usernames(),
    }, status=status)


@login_required
def schedule_edit(request, name: str | None = None):
    schedule = get_object_or_404(Schedule, name=name) if name else None
    require_operator(request, "Editing a schedule" if schedule else "Creating a schedule")
    if request.method == "POST":
        form, layer_forms = ScheduleForm(request.POST), LayerFormSet(request.POST, prefix="layers")
        if form.is_valid() and layer_forms.is_valid():
            try:
                zone = schedules.time_zone(form.cleaned_data["time_zone"])
                layers = [{"name": data["name"], "rotation": data["rotation"],
                           "starts_at": local_time(data["starts"], zone), "ends_at": local_time(data["ends"], zone),
                           "users": [u.strip() for u in data["users"].split(",") if u.strip()]}
                          for data in (f.cleaned_data for f in layer_forms.forms
                                       if f.has_changed() and not f.cleaned_data.get("DELETE"))]
                saved = schedules.schedule_save(instance=schedule, fields=form.cleaned_data, layers=layers,
                                                actor=request.user)
            except ValidationError as error:
                add_validation_errors(form, error, {"name": "name", "time_zone": "time_zone",
                                                    "description": "description"})
            except Conflict as error:
                form.add_error("name", str(error.detail))
            else:
                messages.success(request, f"Schedule {saved.name} saved.")
                return redirect("alerts:schedule-detail", name=saved.name)
        return render(request, "alerts/schedule_form.html",
                      {"form": form, "layer_forms": layer_forms, "schedule": schedule,
                       "usernames": usernames()}, status=400)
    if schedule:
        form = ScheduleForm(initial={"name": schedule.name, "time_zone": schedule.time_zone,
                                     "description": schedule.description})
        layer_forms = LayerFormSet(initial=layer_initial(schedule), prefix="layers")
    else:
        form, layer_forms = ScheduleForm(), LayerFormSet(prefix="layers")
    return render(request, "alerts/schedule_form.html", {"form": form, "layer_forms": layer_forms,
                                                         "schedule": schedule, "usernames": usernames()})


@console_action(OPERATOR, "Deleting a schedule")
def schedule_remove(request, name: str):
    schedule = get_object_or_404(Schedule, name=name)
    if tell_outcome(request, lambda: schedules.schedule_delete(schedule=schedule, actor=request.user),
                    f"Schedule {name} deleted."):
        return redirect("alerts:schedule-list")
    return redirect("alerts:schedule-detail", name=name)


@console_action(OPERATOR, "Adding an override")
def override_add(request, name: str):
    schedule = get_object_or_404(Schedule, name=name)
    form = OverrideForm(request.POST)
    if form.is_valid():
        zone = schedules.time_zone(schedule.time_zone)
        data = form.cleaned_data
        try:
            override = schedules.override_create(schedule=schedule, username=data["user"].strip(),
                                                 starts_at=local_time(data["starts"], zone),
                                                 ends_at=local_time(data["ends"], zone), reason=data["reason"],
                                                 actor=request.user)
        except ValidationError as error:
            add_validation_errors(form, error, {"user": "user", "starts_at": "starts", "ends_at": "ends",
                                                "reason": "reason"})
        else:
            messages.success(request, f"{override.user.username} is on call for {schedule.name} from "
                                      f"{local_label(override.starts_at, zone)} to "
                                      f"{local_label(override.ends_at, zone)}.")
            return redirect("alerts:schedule-detail", name=name)
    return schedule_detail(request, name, override_form=form, status=400)


@console_action(OPERATOR, "Removing an override")
def override_remove(request, name: str, pk: int):
    override = get_object_or_404(ScheduleOverride, pk=pk, schedule__name=name)
    schedules.override_delete(override=override, actor=request.user)
    messages.success(request, f"Override of {override.user.username} removed.")
    return redirect("alerts:schedule-detail", name=name)
