"""Who an alert may notify: Alertmanager's silences (label matchers over a time range), its
inhibition (a page inhibits the ticket of the same SLO or rule), and an alert's own snooze.

A muted alert is still stored, shown and resolved; it only notifies no one, and its timeline says
why. Matchers are Alertmanager API v2's: {"name", "value", "isRegex", "isEqual"}; a regex matches
the whole label value (anchored), and a missing label reads as "".
"""

from __future__ import annotations

import re
from datetime import datetime

from alerts.choices import OPEN_STATUSES, Severity
from alerts.models import Alert, Silence


def matcher_holds(matcher: dict, labels: dict[str, str]) -> bool:
    value = labels.get(matcher["name"], "")
    if matcher.get("isRegex"):
        hit = re.fullmatch(matcher["value"], value) is not None
    else:
        hit = value == matcher["value"]
    return hit == matcher.get("isEqual", True)


def active_silences(now: datetime) -> list[Silence]:
    """The silences in force now, the one ending last first (it says how long an alert stays muted)."""
    return list(Silence.objects.filter(starts_at__lte=now, ends_at__gt=now).order_by("-ends_at", "-pk"))


def silence_matching(labels: dict[str, str], silences: list[Silence]) -> Silence | None:
    """The first of these silences whose matchers all hold for the labels."""
    return next((s for s in silences if all(matcher_holds(m, labels) for m in s.matchers)), None)


def inhibiting_alert(alert: Alert) -> Alert | None:
    """An open page of the same alert name and SLO (or rule) inhibits a ticket: one problem pages once."""
    if alert.severity != Severity.TICKET:
        return None
    same = {key: alert.labels[key] for key in ("alertname", "slo", "deployment") if key in alert.labels}
    candidates = Alert.objects.filter(severity=Severity.PAGE, status__in=OPEN_STATUSES).exclude(pk=alert.pk)
    for key, value in same.items():
        candidates = candidates.filter(**{f"labels__{key}": value})
    return candidates.order_by("starts_at").first()


def muting_reason(alert: Alert, now: datetime) -> str:
    """Why the alert notifies no one now ("" when it may)."""
    if alert.snoozed_until and alert.snoozed_until > now:
        return f"snoozed until {alert.snoozed_until:%Y-%m-%d %H:%M} UTC"
    if silence := silence_matching(alert.labels, active_silences(now)):
        return f"silenced by silence {silence.pk} ({silence.comment[:80]})"
    page = inhibiting_alert(alert)
    if page is not None:
        return f"inhibited by page alert {page.pk}"
    return ""
