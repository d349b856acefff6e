"""Multiwindow burn-rate alerts from real evaluations, and their webhook deliveries to a real
HTTP receiver: open once, update while firing, resolve, retries, permanent errors, no double sends."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings

from alerts.models import Alert, Delivery, Notification, Receiver
from alerts.receivers.delivery import notification_deliver
from alerts.routing.dispatch import groups_advance
from alerts.services import notify_unmuted
from alerts.tasks import deliver_notification
from slo.budget import MINUTE
from slo.evaluation import evaluate_slos
from slo.models import SloStatus
from slo.services import slo_create
from tests.conftest import free_port
from tests.slo.conftest import NOW, event, insert_events, make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def ttft_slo(db):
    deployment = make_deployment()
    return slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=500.0,
                      objective=0.99, window="1d", runbook_url="https://runbooks.example/chat-ttft")


def slow_minute(minute, total=40, slow=20):
    insert_events([event(minute, ttft_ms=2000.0 if i < slow else 100.0) for i in range(total)])


def test_fast_burn_pages_then_resolves_when_the_short_window_recovers(ttft_slo, django_capture_on_commit_callbacks):
    Receiver.objects.create(name="oncall", url="http://127.0.0.1:9/hook")
    slow_minute(NOW - MINUTE)
    slow_minute(NOW)
    report = evaluate_slos(now=NOW)
    # 50% slow against a 1% allowance burns 50x: over the 1d window's scaled page windows (2 min
    # and 1 min) and ticket windows (48 and 4 min) alike.
    assert report.alerts_opened == 2
    page = Alert.objects.get(severity="page")
    assert page.status == "firing" and page.starts_at == NOW and page.slo == ttft_slo
    assert page.labels == {"alertname": "SloErrorBudgetBurn", "slo": "chat-ttft", "severity": "page", "sli": "latency",
                           "window": "1d", "scope": "deployment", "deployment": "chat"}
    assert page.annotations["runbook_url"] == "https://runbooks.example/chat-ttft"
    assert "50.0x over 2m and 50.0x over 1m (threshold 14.4x" in page.annotations["description"]
    assert SloStatus.objects.get(slo=ttft_slo).state == "exhausted"

    # Still burning a minute later: the same rows are updated, none opened.
    slow_minute(NOW + MINUTE)
    report = evaluate_slos(now=NOW + MINUTE)
    assert (report.alerts_opened, report.alerts_updated) == (0, 2)
    assert Alert.objects.count() == 2

    # Fixed: the next minute is fast; the 1-minute short window recovers and the page resolves,
    # while the ticket (4-minute short window) still holds.
    insert_events([event(NOW + 2 * MINUTE, ttft_ms=100.0) for _ in range(40)])
    with django_capture_on_commit_callbacks() as callbacks:
        report = evaluate_slos(now=NOW + 2 * MINUTE)
    assert report.alerts_resolved == 1
    page.refresh_from_db()
    assert page.status == "resolved" and page.ends_at == NOW + 2 * MINUTE
    assert Alert.objects.get(severity="ticket").status == "firing"
    # One notification per transition and receiver, enqueued after the commit. The ticket opened
    # beside the page, which inhibits it (one problem pages once): it notified no one, and says why.
    assert sorted(Notification.objects.values_list("alert__severity", "alert_status")) == [
        ("page", "firing"), ("page", "resolved")]
    assert len(callbacks) == 1
    ticket = Alert.objects.get(severity="ticket")
    assert ticket.events.get(kind="muted").text == f"inhibited by page alert {page.pk}"
    # With the page resolved, the ticket still holding notifies: it is in the page's group, which
    # was notified at NOW, so it goes with the group's next news, group_interval (5 min) later.
    assert notify_unmuted(NOW + 2 * MINUTE) == 1
    assert notify_unmuted(NOW + 2 * MINUTE) == 0
    assert groups_advance(NOW + 4 * MINUTE) == {"flushed": 0, "rounds": 0}
    assert not Notification.objects.filter(alert=ticket).exists()
    assert groups_advance(NOW + 5 * MINUTE)["flushed"] == 1
    assert Notification.objects.filter(alert=ticket, alert_status="firing").count() == 1

    # Later the ticket's windows drain too; a new burn opens a new page row (new episode, same fingerprint).
    evaluate_slos(now=NOW + timedelta(hours=1))
    assert not Alert.objects.filter(status="firing").exists()
    later = NOW + timedelta(hours=2)
    slow_minute(later - MINUTE)
    slow_minute(later)
    evaluate_slos(now=later)
    pages = Alert.objects.filter(severity="page").order_by("starts_at")
    assert [a.status for a in pages] == ["resolved", "firing"]
    assert pages[0].fingerprint == pages[1].fingerprint


def test_minimum_traffic_guard(ttft_slo):
    slow_minute(NOW - MINUTE, total=9, slow=9)
    slow_minute(NOW, total=10, slow=10)  # 19 events < min_requests 20
    report = evaluate_slos(now=NOW)
    assert report.alerts_opened == 0
    assert SloStatus.objects.get(slo=ttft_slo).burn_rates["5m"] == pytest.approx(100)
    insert_events([event(NOW, ttft_ms=2000.0)])  # the 20th
    assert evaluate_slos(now=NOW).alerts_opened == 2


def test_slow_burn_tickets_without_paging(ttft_slo):
    # 4% slow for an hour: 4x burn, above the ticket's 3x over 48m and 4m, under the page's 6x and 14.4x.
    for n in range(60):
        insert_events([event(NOW - n * MINUTE, ttft_ms=2000.0 if i == 0 else 100.0) for i in range(25)])
    report = evaluate_slos(now=NOW)
    assert report.alerts_opened == 1
    assert Alert.objects.get().severity == "ticket"
    status = SloStatus.objects.get(slo=ttft_slo)
    # 60 slow of 1500 against a budget of 15: spent four times over.
    assert status.budget_remaining == pytest.approx(-3) and status.state == "exhausted"


def open_alert_with_receiver(ttft_slo, url, **receiver_fields) -> Notification:
    Receiver.objects.create(name="hook", url=url, **receiver_fields)
    slow_minute(NOW - MINUTE)
    slow_minute(NOW)
    evaluate_slos(now=NOW)
    return Notification.objects.get(alert__severity="page")


def test_webhook_delivers_an_alertmanager_v4_payload(ttft_slo, webhook_receiver):
    notification = open_alert_with_receiver(ttft_slo, webhook_receiver.url)
    with override_settings(INFEROPS_EXTERNAL_URL="https://inferops.example"):
        assert notification_deliver(notification_id=notification.pk).outcome == "sent"
    [request] = webhook_receiver.requests
    body = request["body"]
    alert = notification.alert
    assert body["version"] == "4" and body["status"] == "firing" and body["receiver"] == "hook"
    # Grouped by the default route's group_by (alertname, slo, deployment), as Alertmanager writes it.
    assert body["groupLabels"] == {"alertname": "SloErrorBudgetBurn", "slo": "chat-ttft", "deployment": "chat"}
    assert body["groupKey"] == '{}:{alertname="SloErrorBudgetBurn", deployment="chat", slo="chat-ttft"}'
    assert body["commonLabels"] == alert.labels and body["commonAnnotations"] == alert.annotations
    assert body["externalURL"] == "https://inferops.example"
    assert body["alerts"] == [{
        "status": "firing", "labels": alert.labels, "annotations": alert.annotations,
        "startsAt": "2026-03-10T12:00:30Z", "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": f"https://inferops.example/slos/{ttft_slo.pk}/", "fingerprint": alert.fingerprint,
    }]
    # The SLO's console page is addressed by id (its name answered 404 once).
    assert alert.generator_url.endswith(f"/slos/{ttft_slo.pk}/")
    delivery = Delivery.objects.get()
    assert (delivery.attempt, delivery.outcome, delivery.http_status) == (1, "ok", 200)
    # A redelivered task finds the row already sent: nothing is sent twice.
    assert notification_deliver(notification_id=notification.pk).outcome == "skipped"
    assert len(webhook_receiver.requests) == 1


def test_temporary_errors_are_retried_with_a_record_per_attempt(ttft_slo, webhook_receiver):
    webhook_receiver.script = [(503, 0.0), (502, 0.0)]
    notification = open_alert_with_receiver(ttft_slo, webhook_receiver.url)
    # Eager apply runs the retries at once (the countdown only matters on a real worker).
    deliver_notification.apply(args=[notification.pk])
    notification.refresh_from_db()
    assert (notification.status, notification.attempts) == ("sent", 3)
    attempts = list(notification.deliveries.values_list("attempt", "outcome", "http_status"))
    assert attempts == [(1, "temporary-error", 503), (2, "temporary-error", 502), (3, "ok", 200)]
    assert "HTTP 503" in notification.deliveries.get(attempt=1).error
    assert len(webhook_receiver.requests) == 3


def test_client_errors_are_permanent(ttft_slo, webhook_receiver):
    webhook_receiver.script = [(404, 0.0)]
    notification = open_alert_with_receiver(ttft_slo, webhook_receiver.url)
    deliver_notification.apply(args=[notification.pk])
    notification.refresh_from_db()
    assert (notification.status, notification.attempts) == ("failed", 1)
    assert notification.deliveries.get().outcome == "permanent-error"


@override_settings(INFEROPS_WEBHOOK_TIMEOUT_S=0.3, INFEROPS_WEBHOOK_MAX_ATTEMPTS=2)
def test_timeouts_and_refused_connections_are_temporary_up_to_the_attempt_cap(ttft_slo, webhook_receiver):
    webhook_receiver.script = [(200, 1.0)]
    notification = open_alert_with_receiver(ttft_slo, webhook_receiver.url)
    assert notification_deliver(notification_id=notification.pk).outcome == "retry"
    assert "timeout" in notification.deliveries.get(attempt=1).error
    Receiver.objects.filter(pk=notification.receiver_id).update(url=f"http://127.0.0.1:{free_port()}/hook")
    assert notification_deliver(notification_id=notification.pk).outcome == "failed"
    assert "connection failed" in notification.deliveries.get(attempt=2).error


def test_resolved_notifications_only_for_receivers_that_want_them(ttft_slo):
    Receiver.objects.create(name="quiet", url="http://127.0.0.1:9/a", send_resolved=False)
    Receiver.objects.create(name="off", url="http://127.0.0.1:9/b", active=False)
    slow_minute(NOW - MINUTE)
    slow_minute(NOW)
    evaluate_slos(now=NOW)
    evaluate_slos(now=NOW + timedelta(hours=3))
    # The ticket opened under the page is inhibited by it; the page's resolution skips "quiet".
    assert sorted(Notification.objects.values_list("receiver__name", "alert_status", "alert__severity")) == [
        ("quiet", "firing", "page")]


def test_deleting_the_deployment_takes_its_slos_and_ends_their_alerts(ttft_slo):
    slow_minute(NOW - MINUTE)
    slow_minute(NOW)
    evaluate_slos(now=NOW)
    assert Alert.objects.filter(status="firing").count() == 2
    ttft_slo.deployment.delete()  # what the reconciler does once a deleted deployment drained
    assert not SloStatus.objects.exists()
    report = evaluate_slos(now=NOW + MINUTE)
    assert report.alerts_resolved == 2
    assert set(Alert.objects.values_list("status", "slo")) == {("resolved", None)}
