"""The SLO panel of the alert page: for an alert raised on an SLO, its error budget (when the
alert opened and now) and its burn rates and SLI around the alert's time, from the minute rows. A
quality SLO's page is about its eval runs' scores instead: each run's score against the floor."""

from __future__ import annotations

from datetime import timedelta

from django.template.loader import render_to_string
from django.utils import timezone

from slo.api import MAX_HISTORY_POINTS, alert_thresholds, history_points
from slo.budget import BURN_WINDOWS
from slo.choices import SliKind
from slo.evaluation import evaluate_at
from slo.quality import run_history

BEFORE = timedelta(hours=2)  # how much of the lead-up the chart shows
AFTER = timedelta(minutes=30)  # and of the recovery, for a resolved alert
MINUTE_STEPS_UP_TO = timedelta(hours=12)
VISIBLE_WINDOWS = ("5m", "1h", "6h")


def chart_range(alert, now):
    end = min(now, alert.ends_at + AFTER) if alert.ends_at else now
    start = alert.starts_at - BEFORE
    step = "minute" if end - start <= MINUTE_STEPS_UP_TO else "hour"
    # An alert open for months: its last MAX_HISTORY_POINTS hours.
    start = max(start, end - (MAX_HISTORY_POINTS - 1) * timedelta(hours=1))
    return start, end, step


def slo_panel(request, alert) -> str:
    slo = alert.slo
    if slo is None:
        return ""
    if slo.sli_kind == SliKind.QUALITY:
        return quality_panel(request, alert)
    start, end, step = chart_range(alert, timezone.now())
    moments = history_points(start, end, step)
    at_start, *series = evaluate_at([(slo, alert.starts_at), *((slo, moment) for moment in moments)])
    latest = series[-1] if series else at_start
    chart = {
        "times": [ev.at for ev in series], "sli": [ev.budget.sli for ev in series],
        "burn": {name: [round(ev.burn_rates[name], 3) for ev in series] for name in BURN_WINDOWS},
        "visible": VISIBLE_WINDOWS, "thresholds": alert_thresholds(slo), "objective": slo.objective,
        "starts_at": alert.starts_at, "ends_at": alert.ends_at,
    }
    return render_to_string("slo/_alert_panel.html", {
        "slo": slo, "at_start": at_start, "latest": latest, "chart": chart, "step": step,
        "open": alert.is_open,
    }, request=request)


QUALITY_RUNS_SHOWN = 50


def quality_panel(request, alert) -> str:
    """A quality SLO's alert: its last runs' scores against the floor, the alert's time shaded."""
    slo = alert.slo
    runs = run_history(slo, limit=QUALITY_RUNS_SHOWN)
    return render_to_string("slo/_quality_alert_panel.html", {
        "slo": slo, "runs": list(reversed(runs[-5:])),
        "chart": {"runs": runs, "floor": slo.objective, "starts_at": alert.starts_at, "ends_at": alert.ends_at},
    }, request=request)
