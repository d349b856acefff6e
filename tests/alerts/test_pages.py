"""The Alerts console page: firing first, resolved history, deliveries, status filter."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from alerts import services
from alerts.models import Alert, AlertEvent, Integration, Notification, Receiver, Silence
from slo.evaluation import evaluate_slos
from slo.services import slo_create
from tests.slo.conftest import event, insert_events, make_deployment

pytestmark = pytest.mark.django_db


def test_alert_page_lists_firing_first_with_deliveries(client, make_user):
    client.force_login(make_user("viewer"))
    now = timezone.now()
    old = Alert.objects.create(fingerprint="a1", labels={"slo": "chat-ttft"}, severity="ticket", status="resolved",
                               starts_at=now - timedelta(hours=2), ends_at=now - timedelta(hours=1),
                               annotations={"summary": "slow TTFT yesterday"})
    firing = Alert.objects.create(fingerprint="b2", labels={"slo": "chat-avail"}, severity="page",
                                  starts_at=now - timedelta(hours=3), annotations={"summary": "errors burning budget"})
    receiver = Receiver.objects.create(name="oncall", url="http://127.0.0.1:9/hook")
    Notification.objects.create(alert=firing, receiver=receiver, alert_status="firing", status="sent", attempts=1)

    page = client.get("/alerts/")
    assert page.status_code == 200
    text = page.content.decode()
    assert text.index("errors burning budget") < text.index("slow TTFT yesterday")  # firing first
    assert "oncall: firing sent" in text
    assert 'id="silences-link"' in text and 'href="/alerts/silences/"' in text  # silences are one click away
    resolved_only = client.get("/alerts/?status=resolved").content.decode()
    assert "slow TTFT yesterday" in resolved_only and "errors burning budget" not in resolved_only
    assert old.pk and client.get("/alerts/?status=bogus").status_code == 200


def test_alert_page_needs_login(client):
    response = client.get("/alerts/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_a_rollout_alert_links_to_its_rollout(client, make_user):
    client.force_login(make_user("viewer"))
    Alert.objects.create(fingerprint="c3", labels={"alertname": "RolloutAborted", "deployment": "chat", "rollout": "7"},
                         severity="ticket", starts_at=timezone.now(), annotations={"summary": "rollout 7 aborted"})
    text = client.get("/alerts/").content.decode()
    assert '<a href="/deployments/chat/rollouts/7/">rollout 7 of chat</a>' in text


# ---------------------------------------------------------------------------- one alert's page


def integration_alert() -> Alert:
    integration = Integration.objects.create(name="team-am", token_prefix="abc", token_hash="0" * 64)
    return services.alert_raise(
        labels={"alertname": "NodeDiskFull", "instance": "gpu-3", "severity": "page"},
        annotations={"summary": "Disk almost full on gpu-3", "description": "97% used on /var/lib",
                     "runbook_url": "https://runbooks.example/disk-full"},
        severity="page", now=timezone.now() - timedelta(minutes=95), integration=integration,
        generator_url="http://prometheus.example/graph?g0.expr=disk")


def test_an_integration_alert_says_what_fired_and_where_from(client, make_user):
    alert = integration_alert()
    receiver = Receiver.objects.create(name="oncall-hook", url="http://127.0.0.1:9/hook")
    Notification.objects.create(alert=alert, receiver=receiver, alert_status="firing", status="sent", attempts=2,
                                finished_at=timezone.now())
    client.force_login(make_user("viewer"))
    page = client.get(f"/alerts/{alert.pk}/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Disk almost full on gpu-3" in text and "97% used on /var/lib" in text
    assert 'id="alert-status" data-status="firing"' in text
    assert 'href="https://runbooks.example/disk-full"' in text
    assert "integration <strong>team-am</strong>" in text
    assert 'href="http://prometheus.example/graph?g0.expr=disk"' in text
    assert "instance=gpu-3" in text and "1 h 35 min" in text
    assert "not muted" in text
    # The timeline: the opening, then the notification and to whom.
    assert "Opened" in text
    assert "firing to oncall-hook (Webhook (Alertmanager v4 payload)): sent after 2 attempt(s)" in text
    # A viewer reads, and gets no buttons.
    assert 'id="alert-actions"' not in text and 'id="alert-comment-form"' not in text
    listing = client.get("/alerts/").content.decode()
    assert f'href="/alerts/{alert.pk}/"' in listing


def test_a_platform_slo_alert_names_its_slo_and_why_it_is_muted(client, make_user):
    slo = slo_create(actor=None, name="chat-ttft", deployment=make_deployment(), sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", runbook_url="https://runbooks.example/ttft")
    alert = services.alert_raise(labels={"alertname": "SloErrorBudgetBurn", "slo": "chat-ttft", "severity": "page",
                                         "deployment": "chat"},
                                 annotations={"summary": "SLO chat-ttft is burning", "runbook_url": slo.runbook_url},
                                 severity="page", now=timezone.now())
    Alert.objects.filter(pk=alert.pk).update(slo=slo)
    Silence.objects.create(matchers=[{"name": "slo", "value": "chat-ttft", "isRegex": False, "isEqual": True}],
                           starts_at=timezone.now() - timedelta(minutes=1),
                           ends_at=timezone.now() + timedelta(hours=1), created_by="ops", comment="maintenance window")
    client.force_login(make_user("operator"))
    text = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert "the platform" in text and f'href="/slos/{slo.pk}/"' in text
    assert "muted</strong>: silenced by silence" in text and "maintenance window" in text
    assert 'id="runbook" href="https://runbooks.example/ttft"' in text
    assert 'id="alert-ack"' in text and 'id="alert-resolve"' in text and 'id="alert-snooze-15"' in text


def test_an_operator_acts_through_the_page_and_the_timeline_shows_it(client, make_user):
    alert = integration_alert()
    client.force_login(make_user("operator", "alice"))
    response = client.post(f"/alerts/{alert.pk}/acknowledge/", follow=True)
    assert response.redirect_chain[-1][0] == f"/alerts/{alert.pk}/"
    text = response.content.decode()
    assert f"Alert {alert.pk} acknowledged" in text and 'data-status="acknowledged"' in text
    assert 'id="alert-ack"' not in text  # acknowledged already: resolve and snooze remain
    text = client.post(f"/alerts/{alert.pk}/snooze/", {"minutes": "60"}, follow=True).content.decode()
    assert "snoozed for 60 min" in text and 'id="alert-snoozed"' in text and "muted</strong>: snoozed until" in text
    text = client.post(f"/alerts/{alert.pk}/comment/", {"text": "disk cleaned up by cron"},
                       follow=True).content.decode()
    assert "Comment added." in text
    text = client.post(f"/alerts/{alert.pk}/resolve/", follow=True).content.decode()
    assert f"Alert {alert.pk} resolved." in text and 'data-status="resolved"' in text
    rows = [(e.kind, e.actor_name) for e in AlertEvent.objects.filter(alert=alert)]
    assert rows == [("opened", ""), ("acknowledged", "alice"), ("snoozed", "alice"), ("comment", "alice"),
                    ("resolved", "alice")]
    for words in ("Acknowledged", "Snoozed", "disk cleaned up by cron", "Resolved", "for 60 min"):
        assert words in text
    alert.refresh_from_db()
    assert alert.resolved_by.username == "alice" and alert.acknowledged_by.username == "alice"
    # Resolved: no acknowledge, resolve or snooze buttons (a comment still may be added).
    assert 'id="alert-closed"' in text
    assert not any(f'id="{button}"' in text for button in ("alert-ack", "alert-resolve", "alert-snooze-15"))
    assert 'id="alert-comment-form"' in text


def test_refusals_come_back_as_messages(client, make_user):
    alert = integration_alert()
    client.force_login(make_user("operator"))
    for minutes in ("0", "abc", "", "999999"):
        response = client.post(f"/alerts/{alert.pk}/snooze/", {"minutes": minutes}, follow=True)
        assert response.status_code == 200 and "minutes:" in response.content.decode()
    assert client.post(f"/alerts/{alert.pk}/comment/", {"text": "  "}, follow=True).status_code == 200
    client.post(f"/alerts/{alert.pk}/resolve/")
    response = client.post(f"/alerts/{alert.pk}/acknowledge/", follow=True)
    assert response.status_code == 200 and "already resolved: nothing to acknowledge" in response.content.decode()
    response = client.post(f"/alerts/{alert.pk}/resolve/", follow=True)
    assert "already resolved" in response.content.decode()
    assert not AlertEvent.objects.filter(alert=alert, kind="snoozed").exists()


def test_viewers_cannot_act_and_unknown_alerts_are_404(client, make_user):
    alert = integration_alert()
    client.force_login(make_user("viewer"))
    assert client.post(f"/alerts/{alert.pk}/acknowledge/").status_code == 403
    assert client.post(f"/alerts/{alert.pk}/comment/", {"text": "hi"}).status_code == 403
    assert client.get("/alerts/999999/").status_code == 404
    assert client.get(f"/alerts/{alert.pk}/acknowledge/").status_code == 405
    client.logout()
    assert client.get(f"/alerts/{alert.pk}/").status_code == 302


# ---------------------------------------------------------------------------- panels other apps add


def chart_data(text: str) -> dict:
    match = re.search(r'<script id="slo-alert-chart" type="application/json">(.*?)</script>', text, re.S)
    assert match, "the SLO chart's data are not on the page"
    return json.loads(match.group(1))


def test_an_slo_alert_shows_the_budget_and_the_burn_around_its_time(client, make_user):
    deployment = make_deployment()
    slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
               objective=0.99, window="1d", min_requests=10)
    now = timezone.now()
    insert_events([event(now, ttft_ms=100.0) for _ in range(20)] + [event(now, ttft_ms=400.0) for _ in range(20)])
    evaluate_slos(now=now)  # folds the events into minute rows, opens the burn-rate alert
    alert = Alert.objects.get(severity="page")
    client.force_login(make_user("viewer"))
    text = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert 'id="slo-panel"' in text and 'src="/assets/plotly-' in text
    # 20 bad of 40 against a 1% allowance: the budget is long spent, burning at 50x.
    assert re.search(r'id="slo-budget-now"[^>]*>-4900%<', text)
    assert "50.0× over 5m" in text
    chart = chart_data(text)
    assert len(chart["times"]) >= 120  # two hours of minutes before it opened, then until now
    assert chart["burn"]["5m"][-1] == 50.0 and max(chart["burn"]["1h"]) == 50.0
    assert {t["severity"] for t in chart["thresholds"]} == {"page", "ticket"}
    assert chart["starts_at"] and chart["ends_at"] is None
    # The deployment it covers is labelled: its panel follows the SLO's.
    assert text.index('id="slo-panel"') < text.index('id="deployment-panel"')


def test_an_alert_without_slo_or_deployment_has_no_panels(client, make_user):
    alert = integration_alert()
    client.force_login(make_user("operator"))
    text = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert not any(panel in text for panel in ('id="slo-panel"', 'id="deployment-panel"',
                                               'id="degradation-alert-panel"'))


def test_a_notification_the_delivery_recorded_is_listed_once(client, make_user):
    alert = integration_alert()
    pager = Receiver.objects.create(name="pager", kind="pagerduty", url="http://127.0.0.1:9/pd", routing_key="k")
    chat = Receiver.objects.create(name="chat-room", kind="slack", url="http://127.0.0.1:9/slack")
    sent = Notification.objects.create(alert=alert, receiver=pager, alert_status="firing", status="sent", attempts=1,
                                       finished_at=timezone.now())
    services.record_event(alert, "notified", text="firing sent to pager (pagerduty)",
                          data={"notification": sent.pk, "receiver": "pager"})
    Notification.objects.create(alert=alert, receiver=chat, alert_status="firing", status="pending", attempts=2)
    client.force_login(make_user("viewer"))
    text = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert text.count("to pager") == 1
    assert "firing to chat-room (Slack-compatible incoming webhook): retrying after 2 attempt(s)" in text
