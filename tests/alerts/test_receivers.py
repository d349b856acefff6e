"""Receivers of every kind, each against a real server: PagerDuty Events API v2 and Slack-compatible
incoming webhooks against a local HTTP server standing in for PagerDuty's and Slack's endpoints
(tests/alerts/conftest.py: it records each POST and answers from a script), email against a real
SMTP server started with aiosmtpd (tests/conftest.py: smtp_server). Temporary and permanent errors per kind, the failing
marker, the timeline, and the receivers API's validation."""

from __future__ import annotations

import pytest
from django.utils import timezone

from alerts import services
from alerts.models import Alert, Notification, Receiver
from alerts.receivers import kinds as receivers
from alerts.receivers.delivery import notification_deliver
from inferops.models import AuditEvent
from tests.conftest import free_port
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db

EXTERNAL = "https://inferops.example"
ROUTING_KEY = "R0UT1NGKEY0123456789abcdef012345"


@pytest.fixture(autouse=True)
def external_url(settings):
    settings.INFEROPS_EXTERNAL_URL = EXTERNAL


def raise_alert(name: str = "chat-ttft", severity: str = "page") -> Alert:
    return services.alert_raise(
        labels={"alertname": "SloErrorBudgetBurn", "slo": name, "severity": severity, "deployment": "chat"},
        annotations={"summary": f"SLO {name} is burning its error budget too fast ({severity})",
                     "description": "4.0% of the error budget left. Burn rate 50.0x over 2m.",
                     "runbook_url": "https://runbooks.example/chat-ttft"},
        severity=severity, now=timezone.now())


def deliver(alert: Alert, status: str, receiver: Receiver | None = None) -> str:
    """Deliver the one notification of this transition (to this receiver) and return the outcome."""
    rows = Notification.objects.filter(alert=alert, alert_status=status)
    if receiver is not None:
        rows = rows.filter(receiver=receiver)
    return notification_deliver(notification_id=rows.get().pk).outcome


def ack_token_of(url: str) -> str:
    assert url.startswith(f"{EXTERNAL}/alerts/ack/")
    return url.removeprefix(f"{EXTERNAL}/alerts/ack/").rstrip("/")


# ---------------------------------------------------------------------------- PagerDuty


def test_pagerduty_per_alert_trigger_acknowledge_resolve_share_one_dedup_key(webhook_receiver):
    """incident_per alert: the alert's own incident (one incident per group is in test_incidents.py)."""
    webhook_receiver.script = [(202, 0.0)] * 3  # PagerDuty answers 202 Accepted
    pagerduty = Receiver.objects.create(name="pd", kind="pagerduty", url=webhook_receiver.url,
                                        routing_key=ROUTING_KEY, incident_per="alert")
    alert = raise_alert()
    assert deliver(alert, "firing") == "sent"
    services.alert_acknowledge(alert=alert, actor_name="signed link")
    assert deliver(alert, "acknowledged") == "sent"
    services.alert_resolve(alert=Alert.objects.get(pk=alert.pk), now=timezone.now())
    assert deliver(alert, "resolved") == "sent"

    trigger, ack, resolve = (request["body"] for request in webhook_receiver.requests)
    key = f"inferops-{alert.fingerprint}-{alert.pk}"
    page = f"{EXTERNAL}/alerts/{alert.pk}/"
    [link] = [x["href"] for x in trigger["links"] if x["text"] == "Acknowledge"]
    assert services.alert_for_ack_token(ack_token_of(link)) == alert
    assert trigger == {
        "routing_key": ROUTING_KEY, "event_action": "trigger", "dedup_key": key,
        "payload": {
            "summary": "SLO chat-ttft is burning its error budget too fast (page)", "source": "chat",
            "severity": "critical", "timestamp": alert.starts_at.isoformat().replace("+00:00", "Z"),
            "component": "chat", "group": "chat-ttft", "class": "SloErrorBudgetBurn",
            "custom_details": {"labels": alert.labels, "annotations": alert.annotations},
        },
        "links": [{"href": page, "text": "Open the alert"}, {"href": link, "text": "Acknowledge"},
                  {"href": "https://runbooks.example/chat-ttft", "text": "Runbook"}],
        "client": "inferops", "client_url": page,
    }
    assert ack == {"routing_key": ROUTING_KEY, "event_action": "acknowledge", "dedup_key": key}
    assert resolve == {"routing_key": ROUTING_KEY, "event_action": "resolve", "dedup_key": key}
    assert {r["path"] for r in webhook_receiver.requests} == {"/hook"}
    # The timeline says who heard what.
    notified = alert.events.filter(kind="notified").order_by("id")
    assert [e.text for e in notified] == [f"{status} sent to pd (pagerduty)"
                                          for status in ("firing", "acknowledged", "resolved")]
    assert notified[0].data["receiver"] == "pd" and notified[0].data["kind"] == "pagerduty"
    pagerduty.refresh_from_db()
    assert pagerduty.failing_since is None


def test_pagerduty_ticket_is_a_warning_and_the_events_url_defaults_to_pagerdutys(webhook_receiver, monkeypatch):
    monkeypatch.setattr(receivers, "PAGERDUTY_EVENTS_URL", webhook_receiver.url)
    Receiver.objects.create(name="pd", kind="pagerduty", routing_key=ROUTING_KEY)  # no url: the default
    alert = raise_alert(severity="ticket")
    assert deliver(alert, "firing") == "sent"
    assert webhook_receiver.requests[0]["body"]["payload"]["severity"] == "warning"
    assert receivers.PAGERDUTY_EVENTS_URL != "https://events.pagerduty.com/v2/enqueue"  # patched, never reached


def test_pagerduty_rate_limits_and_5xx_retry_a_400_fails_and_marks_the_receiver_failing(webhook_receiver):
    webhook_receiver.script = [(429, 0.0), (500, 0.0), (400, 0.0)]
    pagerduty = Receiver.objects.create(name="pd", kind="pagerduty", url=webhook_receiver.url,
                                        routing_key=ROUTING_KEY)
    alert = raise_alert()
    assert [deliver(alert, "firing") for _ in range(3)] == ["retry", "retry", "failed"]
    notification = Notification.objects.get(alert=alert)
    assert list(notification.deliveries.values_list("outcome", "http_status")) == [
        ("temporary-error", 429), ("temporary-error", 500), ("permanent-error", 400)]
    pagerduty.refresh_from_db()
    assert pagerduty.failing_since is not None and "HTTP 400" in pagerduty.last_error
    failed = alert.events.get(kind="notify-failed")
    assert failed.text.startswith("firing to pd (pagerduty) failed after 3 attempts: HTTP 400")
    first_failure = pagerduty.failing_since

    # Another alert's trigger also fails: the receiver has been failing since the first.
    webhook_receiver.script = [(400, 0.0)]
    assert deliver(raise_alert("other"), "firing", pagerduty) == "failed"
    pagerduty.refresh_from_db()
    assert pagerduty.failing_since == first_failure
    # Someone fixed the key: the next success clears the marker.
    assert deliver(raise_alert("third"), "firing", pagerduty) == "sent"
    pagerduty.refresh_from_db()
    assert (pagerduty.failing_since, pagerduty.last_error) == (None, "")


# ---------------------------------------------------------------------------- Slack


def test_slack_messages_are_readable_with_links(webhook_receiver, make_user):
    Receiver.objects.create(name="chat-ops", kind="slack", url=webhook_receiver.url)
    alert = raise_alert()
    assert deliver(alert, "firing") == "sent"
    services.alert_acknowledge(alert=alert, actor=make_user("operator", "alice"))
    assert deliver(alert, "acknowledged") == "sent"
    services.alert_resolve(alert=Alert.objects.get(pk=alert.pk), now=timezone.now())
    assert deliver(alert, "resolved") == "sent"

    firing, ack, resolved = (request["body"] for request in webhook_receiver.requests)
    assert firing["text"] == "[PAGE] SLO chat-ttft is burning its error budget too fast (page)"
    blocks = "\n".join(block["text"]["text"] for block in firing["blocks"])
    for fact in ("*Severity:* page", "*Deployment:* chat", "*SLO:* chat-ttft",
                 "*Description:* 4.0% of the error budget left. Burn rate 50.0x over 2m.",
                 "*Runbook:* https://runbooks.example/chat-ttft", f"<{EXTERNAL}/alerts/{alert.pk}/|Open the alert>"):
        assert fact in blocks
    link = blocks.split("|Acknowledge>")[0].rsplit("<", 1)[1]
    assert services.alert_for_ack_token(ack_token_of(link)) == alert
    assert ack["text"] == "[ACKNOWLEDGED] SLO chat-ttft is burning its error budget too fast (page) (by alice)"
    assert resolved["text"] == "[RESOLVED] SLO chat-ttft is burning its error budget too fast (page)"
    # Short: one block, with the alert's link and no acknowledgement link.
    assert len(resolved["blocks"]) == 1 and "Acknowledge" not in resolved["blocks"][0]["text"]["text"]


def test_slack_escapes_its_control_characters(webhook_receiver):
    Receiver.objects.create(name="chat-ops", kind="slack", url=webhook_receiver.url)
    alert = services.alert_raise(labels={"alertname": "Custom"}, severity="ticket", now=timezone.now(),
                                 annotations={"summary": "p99 > 2s & <rising>"})
    assert deliver(alert, "firing") == "sent"
    assert "*[TICKET] p99 &gt; 2s &amp; &lt;rising&gt;*" in webhook_receiver.requests[0]["body"]["blocks"][0][
        "text"]["text"]


def test_slack_404_is_permanent(webhook_receiver):
    webhook_receiver.script = [(404, 0.0)]
    slack = Receiver.objects.create(name="chat-ops", kind="slack", url=webhook_receiver.url)
    assert deliver(raise_alert(), "firing") == "failed"
    slack.refresh_from_db()
    assert slack.failing_since is not None and "HTTP 404" in slack.last_error


# ---------------------------------------------------------------------------- email


def test_email_reaches_a_real_smtp_server(smtp):
    Receiver.objects.create(name="oncall-mail", kind="email", to=["oncall@example.com", "lead@example.com"])
    alert = raise_alert()
    assert deliver(alert, "firing") == "sent"
    services.alert_resolve(alert=alert, now=timezone.now())
    assert deliver(alert, "resolved") == "sent"

    (firing_to, firing), (_, resolved) = smtp.messages
    assert firing_to == ["oncall@example.com", "lead@example.com"]
    assert firing["Subject"] == "[PAGE] SLO chat-ttft is burning its error budget too fast (page)"
    assert firing["From"] == "inferops@example.com"
    text = firing.get_body(("plain",)).get_content()
    html = firing.get_body(("html",)).get_content()
    for fact in ("Severity: page", "Deployment: chat", "SLO: chat-ttft", "Runbook: https://runbooks.example/chat-ttft",
                 f"Open the alert: {EXTERNAL}/alerts/{alert.pk}/"):
        assert fact in text
    link = text.split("Acknowledge: ")[1].split()[0]
    assert services.alert_for_ack_token(ack_token_of(link)) == alert
    assert f"<a href='{link}'>Acknowledge</a>" in html and "<th align='left'>SLO</th><td>chat-ttft</td>" in html
    assert resolved["Subject"] == "[RESOLVED] SLO chat-ttft is burning its error budget too fast (page)"
    assert "Acknowledge" not in resolved.get_body(("plain",)).get_content()
    assert alert.events.filter(kind="notified", data__kind="email").count() == 2


def test_smtp_4xx_and_refused_connections_retry_5xx_fails(smtp, smtp_server, settings):
    mail = Receiver.objects.create(name="oncall-mail", kind="email", to=["oncall@example.com"])
    alert = raise_alert()
    smtp.rcpt_replies = ["451 4.3.0 Mailbox busy, try later", "550 5.1.1 No such user"]
    assert deliver(alert, "firing") == "retry"
    assert deliver(alert, "firing") == "failed"
    notification = Notification.objects.get(alert=alert)
    assert list(notification.deliveries.values_list("outcome", flat=True)) == ["temporary-error", "permanent-error"]
    assert "451" in notification.deliveries.get(attempt=1).error
    mail.refresh_from_db()
    assert mail.failing_since is not None and "550" in mail.last_error

    settings.EMAIL_PORT = free_port()  # nothing listens: connection refused
    other = raise_alert("other")
    assert deliver(other, "firing") == "retry"
    assert "SMTP connection failed" in Notification.objects.get(alert=other).deliveries.get().error
    settings.EMAIL_PORT = smtp_server[1]  # back: the next success clears the marker
    assert deliver(other, "firing") == "sent"
    mail.refresh_from_db()
    assert mail.failing_since is None


# ---------------------------------------------------------------------------- the receivers API


@pytest.fixture
def admin_api(api):
    return api("admin")


@pytest.mark.parametrize("body, field, message", [
    ({"name": "hook", "kind": "webhook"}, "url", "webhook receivers need url: the URL to POST to."),
    ({"name": "hook"}, "url", "webhook receivers need url: the URL to POST to."),
    ({"name": "chat", "kind": "slack"}, "url", "slack receivers need url: its incoming webhook URL."),
    ({"name": "pd", "kind": "pagerduty", "url": "https://events.example/v2/enqueue"}, "routing_key",
     "pagerduty receivers need routing_key: its integration key."),
    ({"name": "mail", "kind": "email"}, "to", "email receivers need to: at least one address."),
    ({"name": "mail", "kind": "email", "to": []}, "to", "email receivers need to: at least one address."),
    ({"name": "mail", "kind": "email", "to": ["a@example.com"], "url": "https://x.example/"}, "url",
     "email receivers have no url."),
    ({"name": "hook", "url": "https://x.example/", "routing_key": "k"}, "routing_key",
     "webhook receivers have no routing_key."),
    ({"name": "hook", "url": "https://x.example/", "to": ["a@example.com"]}, "to", "webhook receivers have no to."),
    ({"name": "hook", "kind": "sms", "url": "https://x.example/"}, "kind", '"sms" is not a valid choice.'),
    ({"name": "hook", "url": "https://x.example/", "secret": "x"}, "secret", "Unknown field."),
    ({"name": "pd", "kind": "pagerduty", "routing_key": "k", "incident_per": "service"}, "incident_per",
     '"service" is not a valid choice.'),
    ({"name": "hook", "url": "https://x.example/", "incident_per": "alert"}, "incident_per",
     "webhook receivers have no incident_per."),
])
def test_receiver_validation_names_the_field(admin_api, body, field, message):
    response = admin_api.post("/api/v1/receivers/", body, format="json")
    assert response.status_code == 400, response.content
    assert response.json()[field] == [message]
    assert not Receiver.objects.exists()


def test_receiver_email_addresses_are_validated(admin_api):
    response = admin_api.post("/api/v1/receivers/", {"name": "mail", "kind": "email",
                                                     "to": ["ok@example.com", "not-an-address"]}, format="json")
    assert response.status_code == 400
    assert response.json()["to"] == {"1": ["Enter a valid email address."]}


def test_routing_key_is_write_only_and_kept_out_of_the_audit_log(admin_api):
    response = admin_api.post("/api/v1/receivers/", {"name": "pd", "kind": "pagerduty", "routing_key": ROUTING_KEY},
                              format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert "routing_key" not in body and body["routing_key_set"] is True
    assert (body["kind"], body["url"], body["to"], body["failing_since"], body["last_error"]) == (
        "pagerduty", "", [], None, "")
    pk = body["id"]
    listed = admin_api.get("/api/v1/receivers/").json()["results"][0]
    for read in (admin_api.get(f"/api/v1/receivers/{pk}/").json(), listed):
        assert "routing_key" not in read and read["routing_key_set"] is True
    assert ROUTING_KEY not in admin_api.get("/api/v1/receivers/").content.decode()
    assert Receiver.objects.get().routing_key == ROUTING_KEY

    # A new key replaces the old; the audit log shows a change without either secret.
    new_key = "N3WKEY" + ROUTING_KEY[6:-4] + "9999"
    assert admin_api.patch(f"/api/v1/receivers/{pk}/", {"routing_key": new_key}, format="json").status_code == 200
    assert Receiver.objects.get().routing_key == new_key
    audits = AuditEvent.objects.filter(action__startswith="receiver.").order_by("id")
    assert [(a.before or {}).get("routing_key") for a in audits] == [None, "****2345"]
    assert [a.after["routing_key"] for a in audits] == ["****2345", "****9999"]
    # Clearing the key of a PagerDuty receiver is refused, naming the field.
    response = admin_api.patch(f"/api/v1/receivers/{pk}/", {"routing_key": ""}, format="json")
    assert response.status_code == 400 and "routing_key" in response.json()


def test_receiver_kinds_round_trip_and_a_kind_change_drops_the_old_fields(admin_api):
    made = admin_api.post("/api/v1/receivers/", {"name": "mail", "kind": "email", "to": ["a@example.com",
                                                                                        "a@example.com"],
                                                "send_resolved": False}, format="json")
    assert made.status_code == 201, made.content
    assert (made.json()["to"], made.json()["send_resolved"], made.json()["routing_key_set"]) == (
        ["a@example.com"], False, False)
    pk = made.json()["id"]
    # email -> slack: needs a url, and drops the addresses.
    assert admin_api.patch(f"/api/v1/receivers/{pk}/", {"kind": "slack"}, format="json").json() == {
        "url": ["slack receivers need url: its incoming webhook URL."]}
    changed = admin_api.patch(f"/api/v1/receivers/{pk}/", {"kind": "slack", "url": "https://hooks.example/T1"},
                              format="json")
    assert changed.status_code == 200, changed.content
    assert (changed.json()["kind"], changed.json()["to"]) == ("slack", [])
    # The plain webhook of before still works as it did: a name and a url.
    legacy = admin_api.post("/api/v1/receivers/", {"name": "hook", "url": "https://hooks.example/am"}, format="json")
    assert legacy.status_code == 201 and legacy.json()["kind"] == "webhook"
    # Failing receivers show it.
    Receiver.objects.filter(pk=pk).update(failing_since=timezone.now(), last_error="HTTP 404: no_team")
    shown = admin_api.get(f"/api/v1/receivers/{pk}/").json()
    assert shown["failing_since"] is not None and shown["last_error"] == "HTTP 404: no_team"
    assert admin_api.patch(f"/api/v1/receivers/{pk}/", {"last_error": ""}, format="json").json()[
        "last_error"] == "HTTP 404: no_team"  # read-only: ignored


def test_the_admin_never_shows_the_routing_key_and_a_blank_one_keeps_it(client):
    from django.contrib.auth.models import User

    client.force_login(User.objects.create_superuser("root", password="pw-12345678"))
    pagerduty = Receiver.objects.create(name="pd", kind="pagerduty", routing_key=ROUTING_KEY)
    page = client.get(f"/admin/alerts/receiver/{pagerduty.pk}/change/").content.decode()
    assert 'name="routing_key"' in page and ROUTING_KEY not in page
    form = {"name": "pd", "kind": "pagerduty", "url": "", "routing_key": "", "to": "[]", "incident_per": "group",
            "send_resolved": "on", "active": "on", "last_error": ""}
    response = client.post(f"/admin/alerts/receiver/{pagerduty.pk}/change/", {**form, "active": ""})
    assert response.status_code == 302, response.content.decode()[:2000]
    pagerduty.refresh_from_db()
    assert (pagerduty.active, pagerduty.routing_key) == (False, ROUTING_KEY)


def test_a_pagerduty_receiver_opens_one_incident_per_group_unless_told_per_alert(admin_api):
    made = admin_api.post("/api/v1/receivers/", {"name": "pd", "kind": "pagerduty", "routing_key": ROUTING_KEY},
                          format="json")
    assert made.status_code == 201 and made.json()["incident_per"] == "group"  # the default, as Alertmanager's
    pk = made.json()["id"]
    changed = admin_api.patch(f"/api/v1/receivers/{pk}/", {"incident_per": "alert"}, format="json")
    assert changed.status_code == 200 and changed.json()["incident_per"] == "alert"
    assert Receiver.objects.get(pk=pk).incident_per == "alert"
    assert AuditEvent.objects.filter(action="receiver.update").get().after["incident_per"] == "alert"
    # Another kind sends one message per group: the setting goes back to its default.
    moved = admin_api.patch(f"/api/v1/receivers/{pk}/", {"kind": "slack", "url": "https://hooks.example/T1"},
                            format="json")
    assert moved.status_code == 200 and moved.json()["incident_per"] == "group"


@pytest.mark.django_db
def test_a_write_to_a_receivers_delivery_list_is_refused_as_it_always_was(api):
    """The list is read-only and admin-only to read: a viewer's POST is 403 (role), an operator's 405."""
    receiver = api("admin").post("/api/v1/receivers/", {"name": "deliveries-405", "url": "http://127.0.0.1:9/hook"},
                                 format="json").json()
    url = f"/api/v1/receivers/{receiver['id']}/deliveries/"
    assert api("viewer").post(url, {}, format="json").status_code == 403
    assert api("operator").post(url, {}, format="json").status_code == 405
    assert api("operator").get(url).status_code == 403
    assert api("admin").get(url).status_code == 200


def test_the_admin_only_lists_and_a_receiver_in_use_answer_as_the_schema_says(api):
    # Found by the REST fuzzer (issue 40): the receiver and integration lists documented no 401 or 403, and
    # deleting a receiver a route sends to answered a 409 the schema did not name.
    for url in ("/api/v1/receivers/", "/api/v1/integrations/"):
        for role, status in ((None, 401), ("operator", 403), ("admin", 200)):
            response = api(role).get(url)
            assert response.status_code == status
            assert_answer_matches_schema(response, "GET", url)
    admin = api("admin")
    receiver = admin.post("/api/v1/receivers/", {"name": "hook", "url": "https://hooks.example/am"}, format="json")
    assert admin.post("/api/v1/routes/", {"matchers": [{"name": "severity", "value": "page", "op": "="}],
                                          "receiver": "hook"}, format="json").status_code == 201
    in_use = admin.delete(f"/api/v1/receivers/{receiver.json()['id']}/")
    assert in_use.status_code == 409
    assert_answer_matches_schema(in_use, "DELETE", "/api/v1/receivers/{id}/")
