"""SLO console: the list by remaining budget, one SLO's budget, burn and SLI charts, create and edit."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Prefetch
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone

from alerts.choices import AlertStatus
from alerts.flags import attach_flags, with_flag_columns
from alerts.models import Alert
from deployments.models import Deployment
from evals.models import EvalSet
from inferops.forms import apply_service
from inferops.roles import require_operator
from inferops.timeparse import DURATION_HINT, format_duration, parse_duration
from registry.models import RegisteredModel
from slo import services
from slo.api import alert_thresholds, slo_queryset
from slo.budget import alert_rules
from slo.choices import RATIO_SERIES, Budgeting, Scope, SliKind, SloState, Window
from slo.models import Slo

SERIES_CHOICES = [("", "—")] + [(name, name) for name in RATIO_SERIES]
FORM_FIELDS = ["name", "description", "owner", "runbook_url", "scope", "deployment", "model", "tenant", "sli_kind",
               "ttft_ms", "tpot_ms", "e2e_ms", "ratio_good", "ratio_total", "eval_set", "eval_every_s", "objective",
               "window", "time_zone", "budgeting", "timeslice_target", "min_requests"]


class SloForm(forms.Form):
    """The API's fields under the model's names, so Slo.clean() errors land on the right field."""

    name = forms.SlugField(max_length=63)
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2, "style": "width:100%"}))
    owner = forms.CharField(required=False, max_length=100)
    runbook_url = forms.URLField(required=False, max_length=500, label="Runbook URL", assume_scheme="https")
    scope = forms.ChoiceField(choices=Scope.choices, initial=Scope.DEPLOYMENT)
    deployment = forms.ModelChoiceField(Deployment.objects.filter(deleted_at=None), to_field_name="name",
                                        required=False, help_text="scopes deployment and tenant")
    model = forms.ModelChoiceField(RegisteredModel.objects.all(), to_field_name="name", required=False,
                                   help_text="scope model: every deployment of it")
    tenant = forms.CharField(required=False, max_length=63, help_text="scope tenant")
    sli_kind = forms.ChoiceField(choices=SliKind.choices, label="SLI")
    ttft_ms = forms.FloatField(required=False, min_value=0, label="TTFT ≤ (ms)")
    tpot_ms = forms.FloatField(required=False, min_value=0, label="TPOT ≤ (ms)")
    e2e_ms = forms.FloatField(required=False, min_value=0, label="E2E ≤ (ms)")
    ratio_good = forms.ChoiceField(choices=SERIES_CHOICES, required=False, label="Ratio: good series")
    ratio_total = forms.ChoiceField(choices=SERIES_CHOICES, required=False, label="Ratio: total series")
    eval_set = forms.ModelChoiceField(EvalSet.objects.all(), to_field_name="name", required=False,
                                      label="Quality: eval set",
                                      help_text="scored on the deployment; a case is an event")
    eval_every_s = forms.CharField(required=False, label="Quality: score every",
                                   help_text="e.g. 15m or 6h (at least 5m)")
    objective = forms.FloatField(help_text="e.g. 0.995; quality: the floor, the fraction of cases that must pass")
    window = forms.ChoiceField(choices=Window.choices, initial=Window.MONTH)
    time_zone = forms.CharField(max_length=64, initial="UTC", help_text="calendar windows start at local midnight")
    budgeting = forms.ChoiceField(choices=Budgeting.choices, initial=Budgeting.OCCURRENCES)
    timeslice_target = forms.FloatField(required=False, help_text="timeslices: a minute is good at this ratio")
    min_requests = forms.IntegerField(
        min_value=0, initial=20, label="Minimum events",
        help_text="fewer in the window: insufficient traffic (not exhausted, no alert, no rollout refused)")

    def clean_eval_every_s(self) -> int | None:
        text = self.cleaned_data["eval_every_s"].strip()
        if not text:
            return None
        try:
            seconds = parse_duration(text, "eval_every_s")
        except ValueError:
            raise forms.ValidationError(f"Expected {DURATION_HINT}.") from None
        if seconds <= 0 or seconds != int(seconds):
            raise forms.ValidationError("A positive whole number of seconds.")
        return int(seconds)

    def slo_fields(self) -> dict:
        data = dict(self.cleaned_data)
        for name in ("ratio_good", "ratio_total", "tenant"):
            data[name] = data[name] or ""
        return data



def target_of(slo: Slo) -> str:
    if slo.scope == Scope.MODEL:
        return f"model {slo.model.name}"
    if slo.scope == Scope.TENANT:
        return f"tenant {slo.tenant} on {slo.deployment.name}"
    return slo.deployment.name


def sli_text(slo: Slo) -> str:
    if slo.sli_kind == SliKind.QUALITY:
        return (f"quality: eval set {slo.eval_set.name} every {format_duration(slo.eval_every_s)}, "
                f"floor {slo.objective:g} of cases passed")
    thresholds = ", ".join(f"{name.split('_')[0].upper()} ≤ {value:g} ms" for name, value in slo.thresholds.items())
    if slo.sli_kind == SliKind.RATIO:
        return f"ratio {slo.ratio_good} / {slo.ratio_total}"
    if slo.sli_kind == SliKind.GOODPUT:
        return f"goodput: success and {thresholds}"
    if slo.sli_kind == SliKind.LATENCY:
        return f"latency: {thresholds}"
    return "availability"


@login_required
def slo_list(request):
    # The most burnt first; then those with too little traffic to judge (a spent budget over two
    # requests is not the most urgent SLO), then the never evaluated, by name.
    firing_alerts = with_flag_columns(Alert.objects.filter(status=AlertStatus.FIRING))
    slos = list(slo_queryset().prefetch_related(Prefetch("alerts", firing_alerts, to_attr="firing"))
                .order_by("status__budget_remaining", "name"))
    attach_flags([alert for slo in slos for alert in slo.firing], timezone.now())
    rows = []
    for slo in slos:
        status = getattr(slo, "status", None)
        firing = slo.firing
        percent = budget_percent(status)
        rows.append({
            "slo": slo, "status": status, "target": target_of(slo), "sli_text": sli_text(slo), "firing": firing,
            "budget_percent": percent, "budget_text": budget_text(status), "traffic": traffic_text(slo, status),
            "burn_1h": burn_text(status.burn_rates.get("1h")) if percent is not None else "—",
        })
    rows.sort(key=lambda row: row["status"] is not None and row["status"].state == SloState.INSUFFICIENT)
    return render(request, "slo/list.html", {"rows": rows})


def budget_text(status) -> str | None:
    """Budget remaining as the evaluation computed it, negative when overspent."""
    if status is None or status.evaluated_at is None:
        return None
    return f"{status.budget_remaining * 100:.1f}%"


def traffic_text(slo: Slo, status) -> str | None:
    """"7 of 50 events" while the window holds too few events to judge the SLO."""
    if status is None or status.state != SloState.INSUFFICIENT:
        return None
    return f"{status.total} of {slo.min_requests} events"


def exhaustion_text(status) -> str:
    if status is None or status.evaluated_at is None:
        return "—"
    if status.state == SloState.INSUFFICIENT:
        return "not judged: insufficient traffic"
    if status.state == SloState.EXHAUSTED:
        return "already exhausted"
    if not status.time_to_exhaustion_s:
        return "not burning"
    seconds = status.time_to_exhaustion_s
    # Whole minutes past an hour: "3d4h12m", not a count of seconds.
    return format_duration(round(seconds / 60) * 60 if seconds >= 3600 else round(seconds))


def rule_texts(slo: Slo) -> list[dict]:
    return [{"severity": rule.severity, "factor": f"{rule.factor:g}",
             "windows": f"{format_duration(rule.long_minutes * 60)} & {format_duration(rule.short_minutes * 60)}"}
            for rule in alert_rules(slo.window)]


def burn_text(rate) -> str:
    return "—" if rate is None else f"{rate:.2f}×"


def budget_percent(status) -> float | None:
    if status is None or status.evaluated_at is None:
        return None
    return max(0.0, min(100.0, status.budget_remaining * 100))


@login_required
def slo_detail(request, pk: int):
    slo = get_object_or_404(slo_queryset(), pk=pk)
    alerts = attach_flags(with_flag_columns(slo.alerts.all())[:100], timezone.now())
    status = getattr(slo, "status", None)
    return render(request, "slo/detail.html", {
        "slo": slo, "status": status, "target": target_of(slo), "sli_text": sli_text(slo),
        "alerts": alerts, "thresholds": alert_thresholds(slo), "rules": rule_texts(slo),
        "budget_text": budget_text(status), "traffic": traffic_text(slo, status),
        "exhaustion": exhaustion_text(status), "evaluation": evaluation_facts(slo, status),
        "quality_every": format_duration(slo.eval_every_s) if slo.eval_every_s else None,
        # The page re-reads itself as often as the SLO is evaluated (and every few seconds until its
        # first evaluation, which creating it has just queued).
        "refresh_ms": round(max(settings.INFEROPS_SLO_EVALUATE_INTERVAL_S, 1) * 1000),
    })


def evaluation_facts(slo: Slo, status) -> dict:
    """What the charts need of the evaluation the header shows, in ISO 8601 to the microsecond: the
    budget chart ends at exactly that evaluation."""
    def iso(moment):
        return moment.isoformat() if moment else None

    evaluated = status is not None and status.evaluated_at is not None
    return {"evaluated_at": iso(status.evaluated_at) if evaluated else None,
            "window_start": iso(status.window_start) if evaluated else None,
            "backfilled_from": iso(slo.backfilled_from)}


@login_required
def slo_by_name(request, name: str):
    # Not permanent: a name deleted and reused names another SLO.
    return redirect("slo:detail", pk=get_object_or_404(Slo, name=name).pk)


@login_required
def slo_create(request):
    require_operator(request, "Changing SLOs")
    form = SloForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        created = apply_service(form, lambda: services.slo_create(actor=request.user, **form.slo_fields()))
        if created:
            return redirect("slo:detail", pk=created.pk)
    return render(request, "slo/form.html", {"form": form, "title": "New SLO"})


@login_required
def slo_edit(request, pk: int):
    require_operator(request, "Changing SLOs")
    slo = get_object_or_404(slo_queryset(), pk=pk)
    initial = {name: getattr(slo, name) for name in FORM_FIELDS}
    shown = {**initial, "eval_every_s": format_duration(slo.eval_every_s) if slo.eval_every_s else ""}
    form = SloForm(request.POST or None, initial=shown)
    if request.method == "POST" and form.is_valid():
        changes = {name: value for name, value in form.slo_fields().items() if value != initial[name]}
        updated = apply_service(form, lambda: services.slo_update(slo=slo, actor=request.user, **changes))
        if updated:
            return redirect("slo:detail", pk=slo.pk)
    return render(request, "slo/form.html", {"form": form, "title": f"Change {slo.name}", "slo": slo})
