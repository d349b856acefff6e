"""Panels other apps add to the alert page (the SLO's burn, the deployment's replicas and
rollouts, its degradation level), so alerts, the lowest layer, imports none of them. Positions
put what burns first, then what changed on the deployment, then how far it is degraded.

Alerts also adds the home page's "Firing now" and "On call" panels (registered here: every app's
ready() imports this module, and alerts' own pages do too)."""

from django.template.loader import render_to_string
from django.utils import timezone

from alerts.choices import AlertStatus
from alerts.flags import attach_flags, muted_count, with_flag_columns
from alerts.models import Alert, Schedule
from alerts.schedules.services import on_call_summary
from inferops.panels import PanelRegistry, home_panels

_registry = PanelRegistry()
register = _registry.register
render_panels = _registry.render

SLO, DEPLOYMENT, DEGRADATION = 10, 20, 30


FIRING, ON_CALL = 5, 10
FIRING_SHOWN = 10


def firing_panel(request, _obj) -> str:
    """The alerts firing now, newest first: what the on-call engineer opens first."""
    now = timezone.now()
    firing = Alert.objects.filter(status=AlertStatus.FIRING)
    shown = attach_flags(with_flag_columns(firing).order_by("-starts_at", "-id")[:FIRING_SHOWN], now)
    total, muted = firing.count(), muted_count(firing, now)
    return render_to_string("alerts/_home_firing.html", {
        "alerts": shown, "total": total, "muted": muted, "live": total - muted, "now": now,
    }, request=request)


def on_call_panel(request, _obj) -> str:
    """Who is on call now and next on every schedule, and how many alerts are firing."""
    now = timezone.now()
    rows = [{"schedule": schedule, **on_call_summary(schedule, now)} for schedule in Schedule.objects.all()]
    firing = Alert.objects.filter(status=AlertStatus.FIRING)
    total, muted = firing.count(), muted_count(firing, now)
    return render_to_string("alerts/schedule_on_call_panel.html", {
        "rows": rows, "firing": total, "muted": muted, "live": total - muted}, request=request)


home_panels.register(firing_panel, FIRING)
home_panels.register(on_call_panel, ON_CALL)
