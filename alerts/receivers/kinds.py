"""What each receiver kind sends: one function per kind builds the message for a transition
(firing, acknowledged, resolved) of one alert or of several alerts of a group, and sends it
through the shared transport. A webhook gets Alertmanager's grouped payload, Slack and email one
message listing the alerts. PagerDuty gets, by default, one incident per notification group, as
Alertmanager's own integration does: one `dedup_key` per route and group labels, a trigger listing
the group's firing alerts (again, with the same key, when alerts join), one acknowledge and one
resolve (alerts/services.py decides when the group has them). A receiver with `incident_per` alert
gets one event per alert instead, each with its own `dedup_key`.

Webhook, PagerDuty and Slack POST JSON through `webhook.post_json`; email goes through Django's
email backend. Every kind raises `DeliveryError(permanent=...)`, so delivery treats them alike.
"""

from __future__ import annotations

import smtplib

from django.conf import settings
from django.core.mail import EmailMultiAlternatives
from django.utils.html import format_html, format_html_join

from alerts.choices import OPEN_STATUSES, AlertStatus, EventKind, IncidentPer, ReceiverKind, Severity
from alerts.models import Alert, AlertGroup, Receiver
from alerts.receivers.webhook import DeliveryError, _common, alertmanager_payload, post_json, rfc3339
from alerts.services import ack_url

PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
PAGERDUTY_ACTIONS = {AlertStatus.FIRING: "trigger", AlertStatus.ACKNOWLEDGED: "acknowledge",
                     AlertStatus.RESOLVED: "resolve"}
PAGERDUTY_SEVERITY = {Severity.PAGE: "critical", Severity.TICKET: "warning"}


def alert_page_url(alert: Alert) -> str:
    return f"{settings.INFEROPS_EXTERNAL_URL}/alerts/{alert.pk}/"


def summary_of(alert: Alert) -> str:
    return alert.annotations.get("summary") or alert.labels.get("alertname", f"alert {alert.pk}")


def acknowledger(alert: Alert) -> str:
    if alert.acknowledged_by_id:
        return alert.acknowledged_by.username
    event = alert.events.filter(kind=EventKind.ACKNOWLEDGED).order_by("-at", "-id").first()
    return (event.actor_name if event else "") or "someone"


def facts(alert: Alert) -> list[tuple[str, str]]:
    """What a person reads first, in the order they need it; empty facts are left out."""
    rows = [("Severity", alert.severity), ("Since", f"{alert.starts_at:%Y-%m-%d %H:%M:%S} UTC"),
            ("Deployment", alert.labels.get("deployment", "")), ("SLO", alert.labels.get("slo", "")),
            ("Description", alert.annotations.get("description", "")),
            ("Runbook", alert.annotations.get("runbook_url", ""))]
    return [(name, value) for name, value in rows if value]


def links(alert: Alert, status: str) -> list[tuple[str, str]]:
    """(text, href): the alert's page, and the signed acknowledgement link while nobody has it."""
    found = [("Open the alert", alert_page_url(alert))]
    if status == AlertStatus.FIRING:
        found.append(("Acknowledge", ack_url(alert)))
    return found


def headline(alerts: list[Alert], status: str) -> str:
    """`[PAGE] summary` for one alert, `[PAGE:3] summary (and 2 more)` for a group's."""
    alert, more = alerts[0], len(alerts) - 1
    tag = "RESOLVED" if status == AlertStatus.RESOLVED else alert.severity.upper()
    if status == AlertStatus.ACKNOWLEDGED:
        tag = "ACKNOWLEDGED"
    count = f":{len(alerts)}" if more else ""
    line = f"[{tag}{count}] {summary_of(alert)}" + (f" (and {more} more)" if more else "")
    if status == AlertStatus.ACKNOWLEDGED:
        line += f" (by {acknowledger(alert)})"
    return line


# ---------------------------------------------------------------------------- webhook


def send_webhook(alerts: list[Alert], receiver: Receiver, status: str, group=None) -> int:
    payload = alertmanager_payload(alerts=alerts, receiver=receiver.name, status=status,
                                   external_url=settings.INFEROPS_EXTERNAL_URL, group=group)
    return post_json(receiver.url, payload, timeout_s=settings.INFEROPS_WEBHOOK_TIMEOUT_S)


# ---------------------------------------------------------------------------- PagerDuty Events API v2


def dedup_key(alert: Alert) -> str:
    """One incident per alert episode: the trigger, acknowledge and resolve of one alert row share it."""
    return f"inferops-{alert.fingerprint}-{alert.pk}"


def group_dedup_key(group: AlertGroup) -> str:
    """One incident per notification group: the group's key hashes its route and label values, so it
    is stable across the group's episodes (PagerDuty opens a new incident for a trigger after a resolve)."""
    return f"inferops-group-{group.key}"


def groups_incidents(receiver: Receiver, group: AlertGroup | None) -> bool:
    return receiver.incident_per == IncidentPer.GROUP and group is not None


def pagerduty_event(alert: Alert, receiver: Receiver, status: str) -> dict:
    event = {"routing_key": receiver.routing_key, "event_action": PAGERDUTY_ACTIONS[status],
             "dedup_key": dedup_key(alert)}
    if status != AlertStatus.FIRING:
        return event
    labels = alert.labels
    payload = {
        "summary": summary_of(alert)[:1024],
        "source": labels.get("deployment") or labels.get("instance") or labels.get("model") or "inferops",
        "severity": PAGERDUTY_SEVERITY.get(alert.severity, "error"),
        "timestamp": rfc3339(alert.starts_at),
        "component": labels.get("deployment") or labels.get("model", ""),
        "group": labels.get("slo") or labels.get("tenant", ""),
        "class": labels.get("alertname", ""),
        "custom_details": {"labels": labels, "annotations": alert.annotations},
    }
    page = alert_page_url(alert)
    hrefs = [{"href": href, "text": text} for text, href in links(alert, status)]
    if runbook := alert.annotations.get("runbook_url"):
        hrefs.append({"href": runbook, "text": "Runbook"})
    return {**event, "payload": {k: v for k, v in payload.items() if v}, "links": hrefs,
            "client": "inferops", "client_url": page}


def incident_alerts(group: AlertGroup, receiver: Receiver, sending: list[Alert]) -> list[Alert]:
    """What the group's incident is about: its open alerts this receiver has been told of (those
    being sent now included), oldest first; muted ones it never heard of stay out."""
    told = (group.alerts.filter(status__in=OPEN_STATUSES, notifications__receiver=receiver,
                                notifications__group=group, notifications__alert_status=AlertStatus.FIRING)
            .distinct().order_by("starts_at", "pk"))
    alerts = {alert.pk: alert for alert in told}
    for alert in sending:
        alerts.setdefault(alert.pk, alert)
    return sorted(alerts.values(), key=lambda a: (a.starts_at, a.pk))


def pagerduty_group_event(alerts: list[Alert], receiver: Receiver, status: str, group: AlertGroup) -> dict:
    """One event for the group's incident; a trigger lists its firing alerts and counts them."""
    event = {"routing_key": receiver.routing_key, "event_action": PAGERDUTY_ACTIONS[status],
             "dedup_key": group_dedup_key(group)}
    if status != AlertStatus.FIRING:
        return event
    firing = incident_alerts(group, receiver, alerts)
    first, more = firing[0], len(firing) - 1
    common = _common([a.labels for a in firing])
    runbooks = {a.annotations.get("runbook_url") for a in firing}
    summary = summary_of(first) + (f" (and {more} more)" if more else "")
    severity = Severity.PAGE if any(a.severity == Severity.PAGE for a in firing) else Severity.TICKET
    # Alertmanager's names: `firing` lists the alerts, `num_firing` counts them.
    details = {"num_firing": len(firing), "group_labels": group.labels, "common_labels": common, "firing": [
        {"summary": summary_of(a), "severity": a.severity, "starts_at": rfc3339(a.starts_at), "labels": a.labels,
         "annotations": a.annotations, "url": alert_page_url(a)} for a in firing[:LISTED]]}
    if len(firing) > LISTED:
        details["not_listed"] = len(firing) - LISTED
    payload = {
        "summary": summary[:1024],
        "source": common.get("deployment") or common.get("instance") or common.get("model") or "inferops",
        "severity": PAGERDUTY_SEVERITY[severity],
        "timestamp": rfc3339(first.starts_at),
        "component": common.get("deployment") or common.get("model", ""),
        "group": common.get("slo") or common.get("tenant", ""),
        "class": common.get("alertname", ""),
        "custom_details": details,
    }
    # Acknowledging any alert of the group acknowledges the incident: the first one's link will do.
    hrefs = [{"href": href, "text": text} for text, href in links(first, status)]
    if more:
        hrefs.append({"href": alerts_url(), "text": f"All alerts ({len(firing)} firing in this group)"})
    if len(runbooks) == 1 and (runbook := runbooks.pop()):
        hrefs.append({"href": runbook, "text": "Runbook"})
    return {**event, "payload": {k: v for k, v in payload.items() if v}, "links": hrefs,
            "client": "inferops", "client_url": alert_page_url(first)}


def send_pagerduty(alerts: list[Alert], receiver: Receiver, status: str, group=None) -> int:
    """One event for the group's incident, or (incident_per alert, or an alert outside any group)
    one per alert: a retry after a partial failure sends the earlier ones again, which PagerDuty
    folds into the same incidents by their dedup_key."""
    url = receiver.url or PAGERDUTY_EVENTS_URL
    if groups_incidents(receiver, group):
        return post_json(url, pagerduty_group_event(alerts, receiver, status, group),
                         timeout_s=settings.INFEROPS_WEBHOOK_TIMEOUT_S)
    for alert in alerts:
        http_status = post_json(url, pagerduty_event(alert, receiver, status),
                                timeout_s=settings.INFEROPS_WEBHOOK_TIMEOUT_S)
    return http_status


# ---------------------------------------------------------------------------- Slack-compatible webhook


def _mrkdwn(text: str) -> str:
    # Slack's three control characters; everything else is literal.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# At most this many alerts are listed in one chat message or email; the rest are counted.
LISTED = 20


def slack_message(alerts: list[Alert], status: str) -> dict:
    """`text` for notifications and clients without blocks; blocks for a readable message. An
    acknowledgement or a resolution of one alert is one short block with its link."""
    text = headline(alerts, status)

    def section(mrkdwn: str) -> dict:
        return {"type": "section", "text": {"type": "mrkdwn", "text": mrkdwn}}

    def link_line(alert: Alert) -> str:
        return " · ".join(f"<{href}|{name}>" for name, href in links(alert, status))

    if len(alerts) == 1 and status != AlertStatus.FIRING:
        return {"text": text, "blocks": [section(f"*{_mrkdwn(text)}*\n{link_line(alerts[0])}")]}
    blocks = [section(f"*{_mrkdwn(text)}*")]
    for alert in alerts[:LISTED]:
        lines = [f"*{_mrkdwn(summary_of(alert))}*"] if len(alerts) > 1 else []
        if status == AlertStatus.FIRING:
            lines += [f"*{name}:* {_mrkdwn(value)}" for name, value in facts(alert)]
        blocks.append(section("\n".join([*lines, link_line(alert)])))
    if len(alerts) > LISTED:
        blocks.append(section(f"and {len(alerts) - LISTED} more alerts: <{alerts_url()}|all alerts>"))
    return {"text": text, "blocks": blocks}


def alerts_url() -> str:
    return f"{settings.INFEROPS_EXTERNAL_URL}/alerts/"


def send_slack(alerts: list[Alert], receiver: Receiver, status: str, group=None) -> int:
    return post_json(receiver.url, slack_message(alerts, status), timeout_s=settings.INFEROPS_WEBHOOK_TIMEOUT_S)


# ---------------------------------------------------------------------------- email


def email_message(alerts: list[Alert], receiver: Receiver, status: str) -> EmailMultiAlternatives:
    title = headline(alerts, status)
    listed = alerts[:LISTED]
    text_parts, html_parts = [title, ""], []
    for alert in listed:
        rows, hrefs = facts(alert), links(alert, status)
        if len(alerts) > 1:
            text_parts += [summary_of(alert)]
        text_parts += [*(f"{name}: {value}" for name, value in rows), *(f"{name}: {href}" for name, href in hrefs), ""]
        html_parts.append(format_html(
            "{}<table>{}</table><p>{}</p>",
            format_html("<h3>{}</h3>", summary_of(alert)) if len(alerts) > 1 else "",
            format_html_join("", "<tr><th align='left'>{}</th><td>{}</td></tr>", rows),
            format_html_join(" · ", "<a href='{1}'>{0}</a>", hrefs)))
    if len(alerts) > LISTED:
        text_parts += [f"and {len(alerts) - LISTED} more alerts: {alerts_url()}", ""]
        html_parts.append(format_html("<p>and {} more alerts: <a href='{}'>all alerts</a></p>",
                                      len(alerts) - LISTED, alerts_url()))
    html = format_html("<p><strong>{}</strong></p>{}", title, format_html_join("", "{}", ((p,) for p in html_parts)))
    message = EmailMultiAlternatives(subject=title[:250], body="\n".join(text_parts),
                                     from_email=settings.DEFAULT_FROM_EMAIL, to=list(receiver.to))
    message.attach_alternative(html, "text/html")
    return message


def send_email(alerts: list[Alert], receiver: Receiver, status: str, group=None) -> None:
    """SMTP 4xx, refused connections and timeouts are temporary; 5xx rejections are permanent."""
    try:
        email_message(alerts, receiver, status).send()
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [code for code, _ in exc.recipients.values()]
        raise DeliveryError(f"SMTP recipients refused: {exc.recipients}",
                            permanent=all(code >= 500 for code in codes)) from exc
    except smtplib.SMTPResponseException as exc:
        detail = exc.smtp_error.decode(errors="replace") if isinstance(exc.smtp_error, bytes) else exc.smtp_error
        raise DeliveryError(f"SMTP {exc.smtp_code}: {detail}", permanent=exc.smtp_code >= 500) from exc
    except smtplib.SMTPNotSupportedError as exc:  # e.g. STARTTLS asked of a server without it
        raise DeliveryError(f"SMTP: {exc}", permanent=True) from exc
    except (smtplib.SMTPException, OSError) as exc:  # disconnected, refused, timed out
        raise DeliveryError(f"SMTP connection failed: {exc!r}", permanent=False) from exc


SENDERS = {ReceiverKind.WEBHOOK: send_webhook, ReceiverKind.PAGERDUTY: send_pagerduty,
           ReceiverKind.SLACK: send_slack, ReceiverKind.EMAIL: send_email}


def send(alerts: list[Alert], receiver: Receiver, status: str, group=None) -> int | None:
    """Send one transition of these alerts (one alert, or several of `group`) to one receiver;
    returns the HTTP status (None for email) or raises DeliveryError."""
    return SENDERS[receiver.kind](alerts, receiver, status, group)
