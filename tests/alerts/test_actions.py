"""People acting on alerts: acknowledge, resolve, snooze, comment (API and signed link), and who
hears about it; silences and inhibition mute notifications, never the alert."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from alerts import services
from alerts.models import Alert, AlertEvent, Notification, Receiver, Silence
from alerts.silences.muting import matcher_holds, muting_reason
from inferops.models import AuditEvent
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db


def raise_alert(severity: str = "page", **labels) -> Alert:
    labels = {"alertname": "HighLatency", "deployment": "chat", "severity": severity, **labels}
    return services.alert_raise(labels=labels, annotations={"summary": "TTFT p95 above 2 s"}, severity=severity,
                                now=timezone.now())


@pytest.fixture
def receivers(db):
    return {kind: Receiver.objects.create(name=kind, kind=kind, url=f"http://127.0.0.1:9/{kind}",
                                          routing_key="key" if kind == "pagerduty" else "")
            for kind in ("webhook", "pagerduty", "slack")}


def sent(alert) -> list[tuple[str, str]]:
    return sorted(Notification.objects.filter(alert=alert).values_list("receiver__name", "alert_status"))


def test_acknowledge_then_resolve_through_the_api(api, receivers):
    alert = raise_alert()
    client = api("operator")
    body = client.post(f"/api/v1/alerts/{alert.pk}/ack/", format="json").json()
    assert body["status"] == "acknowledged" and body["acknowledged_by"] == "operator-api"
    assert client.post(f"/api/v1/alerts/{alert.pk}/ack/", format="json").json()["status"] == "acknowledged"
    # Every receiver heard it open; only those with an acknowledge event hear the acknowledgement.
    assert sent(alert) == [("pagerduty", "acknowledged"), ("pagerduty", "firing"), ("slack", "acknowledged"),
                           ("slack", "firing"), ("webhook", "firing")]
    body = client.post(f"/api/v1/alerts/{alert.pk}/resolve/", format="json").json()
    assert body["status"] == "resolved" and body["resolved_by"] == "operator-api"
    assert ("webhook", "resolved") in sent(alert) and ("pagerduty", "resolved") in sent(alert)
    assert client.post(f"/api/v1/alerts/{alert.pk}/resolve/", format="json").status_code == 409
    assert client.post(f"/api/v1/alerts/{alert.pk}/ack/", format="json").status_code == 409
    kinds = [event["kind"] for event in client.get(f"/api/v1/alerts/{alert.pk}/comments/").json()]
    assert kinds == ["opened", "acknowledged", "resolved"]
    assert AuditEvent.objects.filter(action__in=["alert.acknowledge", "alert.resolve"]).count() == 2


def test_people_paged_by_email_hear_the_acknowledgement_too(api, receivers):
    Receiver.objects.create(name="mail", kind="email", to=["oncall@example.com"])
    alert = raise_alert()
    services.alert_acknowledge(alert=alert, actor=None, actor_name="signed link")
    assert ("mail", "acknowledged") in sent(alert) and ("webhook", "acknowledged") not in sent(alert)


def test_viewers_cannot_act(api):
    alert = raise_alert()
    assert api("viewer").post(f"/api/v1/alerts/{alert.pk}/ack/", format="json").status_code == 403
    assert api(None).post(f"/api/v1/alerts/{alert.pk}/ack/", format="json").status_code == 401


def test_snooze_and_comment(api, receivers):
    alert = raise_alert()
    client = api("operator")
    body = client.post(f"/api/v1/alerts/{alert.pk}/snooze/", {"minutes": 30}, format="json").json()
    assert body["status"] == "firing" and body["snoozed_until"]
    alert.refresh_from_db()
    assert muting_reason(alert, timezone.now()).startswith("snoozed until")
    assert not muting_reason(alert, timezone.now() + timedelta(minutes=31))
    comment = client.post(f"/api/v1/alerts/{alert.pk}/comments/", {"text": "rolling back v7"}, format="json")
    assert comment.status_code == 201 and comment.json()["text"] == "rolling back v7"
    assert comment.json()["actor_name"] == "operator-api"


@pytest.mark.parametrize(("path", "body", "field"), [
    ("snooze", {"minutes": 0}, "minutes"), ("snooze", {"minutes": "soon"}, "minutes"),
    ("snooze", {}, "minutes"), ("snooze", {"minutes": 99999}, "minutes"),
    ("comments", {"text": ""}, "text"), ("comments", {"txt": "x"}, "txt"), ("ack", {"force": True}, "force"),
])
def test_bad_action_bodies_are_400(api, path, body, field):
    alert = raise_alert()
    response = api("operator").post(f"/api/v1/alerts/{alert.pk}/{path}/", body, format="json")
    assert response.status_code == 400 and field in response.json()
    assert not AlertEvent.objects.exclude(kind="opened").exists()


def test_unknown_alert_is_404(api):
    assert api("operator").post("/api/v1/alerts/999999/ack/", format="json").status_code == 404


def test_the_signed_link_acknowledges_one_alert_without_login_and_expires(client, receivers):
    alert = raise_alert()
    other = raise_alert(deployment="other")
    link = f"/alerts/ack/{services.ack_token(alert)}/"
    page = client.get(link)  # a mail scanner opening it changes nothing
    assert page.status_code == 200 and b'id="acknowledge"' in page.content
    alert.refresh_from_db()
    assert alert.status == "firing"
    assert b'id="done"' in client.post(link).content
    alert.refresh_from_db()
    other.refresh_from_db()
    assert (alert.status, other.status) == ("acknowledged", "firing")
    assert alert.events.get(kind="acknowledged").actor_name == "signed link"
    assert client.get(link[:-5] + "xxxx/").status_code == 404
    with override_settings(INFEROPS_ACK_LINK_MAX_AGE_S=-1):
        assert client.post(f"/alerts/ack/{services.ack_token(other)}/").status_code == 410
    other.refresh_from_db()
    assert other.status == "firing"


@pytest.mark.parametrize(("matcher", "labels", "holds"), [
    ({"name": "severity", "value": "page", "isRegex": False, "isEqual": True}, {"severity": "page"}, True),
    ({"name": "severity", "value": "page", "isRegex": False, "isEqual": False}, {"severity": "page"}, False),
    ({"name": "deployment", "value": "chat|embed", "isRegex": True, "isEqual": True}, {"deployment": "chat"}, True),
    ({"name": "deployment", "value": "cha", "isRegex": True, "isEqual": True}, {"deployment": "chat"}, False),
    ({"name": "tenant", "value": "", "isRegex": False, "isEqual": True}, {}, True),  # missing reads as ""
    ({"name": "tenant", "value": "acme", "isRegex": True, "isEqual": False}, {"tenant": "globex"}, True),
])
def test_matchers_read_as_alertmanager_reads_them(matcher, labels, holds):
    assert matcher_holds(matcher, labels) is holds


def test_a_silence_mutes_matching_alerts_only_and_they_notify_once_it_ends(receivers):
    now = timezone.now()
    silence = Silence.objects.create(
        matchers=[{"name": "deployment", "value": "chat", "isRegex": False, "isEqual": True}],
        starts_at=now - timedelta(minutes=1), ends_at=now + timedelta(hours=1), created_by="ops", comment="deploy")
    muted = raise_alert()
    loud = raise_alert(deployment="embed")
    assert sent(muted) == [] and muted.events.get(kind="muted").text.startswith(f"silenced by silence {silence.pk}")
    assert len(sent(loud)) == 3
    Silence.objects.filter(pk=silence.pk).update(ends_at=now)
    assert services.notify_unmuted() == 1
    assert [status for _, status in sent(muted)] == ["firing"] * 3



def test_an_alert_without_a_generator_url_matches_the_schema(api):
    # Found by the REST fuzzer (issue 40): the schema called generator_url a URI, and "" is none.
    alert = raise_alert()
    assert alert.generator_url == ""
    response = api("operator").get(f"/api/v1/alerts/{alert.pk}/")
    assert response.json()["generator_url"] == ""
    assert_answer_matches_schema(response, "GET", "/api/v1/alerts/{id}/")
    assert_answer_matches_schema(api("operator").post(f"/api/v1/alerts/{alert.pk}/ack/"), "POST",
                                 "/api/v1/alerts/{id}/ack/")
