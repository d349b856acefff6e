"""The Alerts console page: firing first, resolved history, deliveries, status filter."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts.models import Alert, Notification, Receiver

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
