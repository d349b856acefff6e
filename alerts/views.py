from datetime import timedelta

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core import signing
from django.core.paginator import Paginator
from django.db.models import Case, IntegerField, Prefetch, Value, When
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST
from rest_framework.exceptions import ValidationError

from alerts import services
from alerts.api import CommentSerializer, SnoozeSerializer
from alerts.choices import OPEN_STATUSES, AlertStatus, EventKind, NotificationStatus
from alerts.flags import attach_flags, with_flag_columns
from alerts.models import Alert, Notification
from alerts.panels import render_panels
from alerts.routing.dispatch import Tree
from alerts.silences.muting import muting_reason
from inferops.api import Conflict
from inferops.roles import require_operator


@login_required
def alert_list(request):
    """Firing alerts first (newest first), then the resolved history, with their webhook deliveries."""
    status = request.GET.get("status", "")
    alerts = (with_flag_columns(Alert.objects.all())
              .prefetch_related(Prefetch("notifications", Notification.objects.select_related("receiver", "user")))
              .annotate(firing_first=Case(When(status__in=OPEN_STATUSES, then=Value(0)), default=Value(1),
                                          output_field=IntegerField()))
              .order_by("firing_first", "-starts_at"))
    if status in AlertStatus.values:
        alerts = alerts.filter(status=status)
    if integration := request.GET.get("integration"):
        alerts = alerts.filter(integration__name=integration)
    page = Paginator(alerts, 50).get_page(request.GET.get("page"))
    page.object_list = attach_flags(page.object_list, timezone.now())
    return render(request, "alerts/list.html", {"page": page, "status": status, "statuses": AlertStatus.choices})


@require_http_methods(["GET", "POST"])
def acknowledge_by_link(request, token: str):
    """The link in a notification: no login, this one alert, until it expires. GET only shows
    what it would acknowledge (mail scanners and chat previews open links); POST acknowledges."""
    try:
        alert = services.alert_for_ack_token(token)
    except signing.SignatureExpired:
        return render(request, "alerts/ack.html", {"problem": "This link has expired: acknowledge the alert from "
                                                              "its page in the console."}, status=410)
    except (signing.BadSignature, ValueError, Alert.DoesNotExist):
        return render(request, "alerts/ack.html", {"problem": "This link is not valid."}, status=404)
    done = False
    if request.method == "POST" and alert.is_open:
        alert = services.alert_acknowledge(alert=alert, actor_name="signed link")
        done = True
    return render(request, "alerts/ack.html", {"alert": alert, "done": done})


def duration_text(delta: timedelta) -> str:
    """How long, to the minute: "3 d 4 h", "2 h 5 min", "12 min", "less than a minute"."""
    minutes = int(delta.total_seconds()) // 60
    days, rest = divmod(minutes, 24 * 60)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min" if minutes else "less than a minute"


def timeline(alert: Alert) -> list[dict]:
    """The alert's events, with each notification sent (or failed) and to whom, by time. A
    notification the delivery already recorded as an event is not listed twice."""
    events = list(alert.events.select_related("actor"))
    entries = [{"at": e.at, "kind": e.kind, "label": e.get_kind_display(), "who": e.actor_name, "text": e.text}
               for e in events]
    recorded = {e.data.get("notification") for e in events if e.data.get("notification")}
    for n in alert.notifications.select_related("receiver", "user"):
        if n.pk in recorded or n.status == NotificationStatus.PENDING and not n.attempts:
            continue
        outcome = {NotificationStatus.SENT: "sent", NotificationStatus.FAILED: "failed",
                   NotificationStatus.PENDING: "retrying"}.get(n.status, n.status)
        entries.append({"at": n.finished_at or n.claimed_at or n.created_at,
                        "kind": EventKind.NOTIFIED if n.status != NotificationStatus.FAILED
                        else EventKind.NOTIFY_FAILED,
                        "label": "Notification", "who": "",
                        "text": f"{n.alert_status} to {n.target_description}: {outcome}"
                                f" after {n.attempts} attempt(s)"})
    return sorted(entries, key=lambda entry: entry["at"])


def routing_facts(alert: Alert) -> list[dict]:
    """Each group the alert is in: its route, what that notifies, and when the group next moves
    (its first notification, the next escalation step or repeat)."""
    tree = Tree()
    facts = []
    for group in alert.groups.select_related("route"):
        notifier = tree.notifier(group.route)
        if notifier.escalation_policy_id:
            steps = notifier.escalation_policy.steps.count()
            target = f"escalation policy {notifier.escalation_policy.name} (step {min(group.round, steps - 1) + 1} " \
                     f"of {steps})" if steps else f"escalation policy {notifier.escalation_policy.name} (no steps)"
        elif notifier.receiver_id:
            target = f"receiver {notifier.receiver.name}"
        else:
            target = "every active receiver"
        if group.flush_at:
            state = f"notifies at {group.flush_at:%H:%M:%S} UTC (waiting for the group's alerts)"
        elif group.round_at and alert.status == AlertStatus.FIRING:
            state = f"unacknowledged: notifies again at {group.round_at:%Y-%m-%d %H:%M:%S} UTC"
        elif group.first_notified_at:
            state = f"notified since {group.first_notified_at:%Y-%m-%d %H:%M:%S} UTC"
        else:
            state = "nobody notified yet"
        facts.append({"route": group.route, "labels": sorted(group.labels.items()), "target": target,
                      "state": state})
    return facts


@login_required
def alert_detail(request, pk: int):
    alert = get_object_or_404(Alert.objects.select_related("slo", "integration", "acknowledged_by", "resolved_by"),
                              pk=pk)
    now = timezone.now()
    return render(request, "alerts/detail.html", {
        "alert": alert, "timeline": timeline(alert), "muted": muting_reason(alert, now) if alert.is_open else "",
        "lasting": duration_text((alert.ends_at or now) - alert.starts_at),
        "snoozed": alert.is_open and alert.snoozed_until and alert.snoozed_until > now,
        "labels": sorted(alert.labels.items()), "snooze_choices": SNOOZE_CHOICES,
        "panels": render_panels(request, alert), "routing": routing_facts(alert),
    })


SNOOZE_CHOICES = [(15, "15 min"), (60, "1 h"), (240, "4 h")]


def _bad_input(errors: dict) -> str:
    return " ".join(f"{field}: {' '.join(map(str, messages_))}" for field, messages_ in errors.items())


@login_required
@require_POST
def alert_action(request, pk: int, action: str):
    """Acknowledge, resolve, snooze or comment from the alert page; a refusal (already resolved,
    bad minutes) comes back as a message on the page, never an error page."""
    require_operator(request, "Acting on alerts")
    alert = get_object_or_404(Alert, pk=pk)
    user = request.user
    try:
        if action == "ack":
            services.alert_acknowledge(alert=alert, actor=user)
            done = f"Alert {pk} acknowledged: escalation stops."
        elif action == "resolve":
            if not alert.is_open:  # the service resolves only open alerts, and says nothing otherwise
                raise Conflict(f"Alert {pk} is already resolved: nothing to resolve.")
            services.alert_resolve(alert=alert, actor=user, now=timezone.now())
            done = f"Alert {pk} resolved."
        elif action == "snooze":
            serializer = SnoozeSerializer(data={"minutes": request.POST.get("minutes", "")})
            serializer.is_valid(raise_exception=True)
            minutes = serializer.validated_data["minutes"]
            services.alert_snooze(alert=alert, actor=user, minutes=minutes)
            done = f"Alert {pk} snoozed for {minutes} min: it notifies no one until then."
        else:
            serializer = CommentSerializer(data={"text": request.POST.get("text", "").strip()})
            serializer.is_valid(raise_exception=True)
            services.alert_comment(alert=alert, actor=user, text=serializer.validated_data["text"])
            done = "Comment added."
    except Conflict as exc:
        messages.error(request, str(exc.detail))
    except ValidationError as exc:
        messages.error(request, _bad_input(exc.detail))
    else:
        messages.success(request, done)
    return redirect("alerts:detail", pk=pk)
