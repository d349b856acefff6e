"""Alerts from a team's Alertmanager: integration tokens (shown once, stored hashed, deactivated),
the Alertmanager-compatible receiver (auth, a real v4 payload firing then resolved, dedup,
idempotency) and bad payloads (400 naming the field, nothing written)."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from alerts.models import Alert, AlertEvent, Integration, Notification, Receiver
from alerts.routing.dispatch import groups_advance
from inferops.models import AuditEvent
from runtime.gateway.contract import hash_api_key

pytestmark = pytest.mark.django_db

URL = "/api/v1/alerts/alertmanager/"


def am_alert(status: str, alertname: str, severity: str, instance: str, **extra) -> dict:
    return {
        "status": status,
        "labels": {"alertname": alertname, "severity": severity, "instance": instance, "job": "node"},
        "annotations": {"summary": f"{alertname} on {instance}", "runbook_url": "https://runbooks.example/x"},
        "startsAt": "2026-12-03T18:00:00.123456789Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-12-03T18:30:00.5Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=up+%3D%3D+0&g0.tab=1",
        "fingerprint": "c7b5e3d1a2f40987",
        **extra,
    }


def payload(status: str, alerts: list[dict]) -> dict:
    """Alertmanager 0.27's webhook body, as it posts it."""
    return {
        "receiver": "inferops", "status": status, "alerts": alerts,
        "groupLabels": {"alertname": alerts[0]["labels"]["alertname"]},
        "commonLabels": {"job": "node"}, "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093", "version": "4",
        "groupKey": '{}/{severity=~"critical|warning"}:{alertname="NodeDown"}', "truncatedAlerts": 0,
    }


@pytest.fixture
def token(api):
    body = api("admin").post("/api/v1/integrations/", {"name": "prod-am"}, format="json").json()
    return body["token"]


@pytest.fixture
def sender(token):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


@pytest.fixture
def receiver(db):
    return Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")


def test_integration_token_is_shown_once_stored_hashed_and_deactivated(api):
    admin = api("admin")
    created = admin.post("/api/v1/integrations/", {"name": "prod-am"}, format="json")
    assert created.status_code == 201
    body = created.json()
    assert set(body) == {"id", "name", "token", "token_prefix", "created_at"}
    assert body["token"].startswith(body["token_prefix"]) and len(body["token"]) > 40
    integration = Integration.objects.get()
    assert integration.token_hash == hash_api_key(body["token"]) and body["token"] not in str(
        AuditEvent.objects.get(action="integration.create").after)
    listed = admin.get("/api/v1/integrations/").json()["results"]
    assert [row["name"] for row in listed] == ["prod-am"] and "token" not in listed[0]
    assert admin.post("/api/v1/integrations/", {"name": "prod-am"}, format="json").status_code == 409
    assert admin.post("/api/v1/integrations/", {"name": "Not A Slug"}, format="json").status_code == 400
    assert admin.post("/api/v1/integrations/", {"name": "x", "tokn": 1}, format="json").json() == {
        "tokn": ["Unknown field."]}

    assert admin.delete(f"/api/v1/integrations/{body['id']}/").status_code == 204
    assert admin.delete(f"/api/v1/integrations/{body['id']}/").status_code == 409
    assert admin.get(f"/api/v1/integrations/{body['id']}/").json()["active"] is False
    assert AuditEvent.objects.filter(action="integration.deactivate").count() == 1
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {body['token']}")
    refused = client.post(URL, payload("firing", [am_alert("firing", "NodeDown", "critical", "a")]), format="json")
    assert refused.status_code == 401 and "deactivated" in refused.json()["detail"]
    assert not Alert.objects.exists()


@pytest.mark.parametrize("role", ["operator", "viewer"])
def test_integrations_are_for_admins(api, role):
    assert api(role).get("/api/v1/integrations/").status_code == 403
    assert api(role).post("/api/v1/integrations/", {"name": "x"}, format="json").status_code == 403
    assert api(None).get("/api/v1/integrations/").status_code == 401


def test_the_receiver_needs_an_integration_token(api, token):
    from rest_framework.test import APIClient

    body = payload("firing", [am_alert("firing", "NodeDown", "critical", "a")])
    for header in (None, "Bearer nope", "Bearer", f"Bearer {token} extra", f"Token {token}", f"Basic {token}"):
        client = APIClient()
        if header:
            client.credentials(HTTP_AUTHORIZATION=header)
        answer = client.post(URL, body, format="json")
        assert answer.status_code == 401, header
        assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    # A person's API token is not an integration's.
    assert api("admin").post(URL, body, format="json").status_code == 401
    assert not Alert.objects.exists()


def test_a_real_payload_fires_then_resolves_deduplicated(sender, receiver):
    firing = [am_alert("firing", "NodeDown", "critical", "node-1:9100"),
              am_alert("firing", "NodeDown", "critical", "node-2:9100"),
              am_alert("firing", "DiskFilling", "warning", "node-1:9100")]
    answer = sender.post(URL, payload("firing", firing), format="json")
    assert answer.status_code == 200 and answer.json() == {"opened": 3, "updated": 0, "resolved": 0}
    alerts = {a.labels["instance"] + a.labels["alertname"]: a for a in Alert.objects.all()}
    down = alerts["node-1:9100NodeDown"]
    assert down.severity == "page" and alerts["node-1:9100DiskFilling"].severity == "ticket"
    assert down.integration.name == "prod-am" and down.generator_url.startswith("http://prometheus:9090/graph")
    assert down.annotations["summary"] == "NodeDown on node-1:9100"
    assert down.starts_at.isoformat().startswith("2026-12-03T18:00:00.123456")
    assert Integration.objects.get().last_used_at is not None
    # Grouped by alertname (the default route's group_by; tests notify new groups at once): the
    # second NodeDown joined a group already notified, so it waits for the group_interval.
    assert Notification.objects.filter(alert_status="firing").count() == 2
    groups_advance(timezone.now() + timedelta(seconds=settings.INFEROPS_ALERT_GROUP_INTERVAL_S))
    assert Notification.objects.filter(alert_status="firing").count() == 3

    # Alertmanager re-sends the group every repeat_interval, and retries: nothing new opens.
    again = sender.post(URL, payload("firing", firing), format="json")
    assert again.json() == {"opened": 0, "updated": 3, "resolved": 0}
    assert Alert.objects.count() == 3 and Notification.objects.count() == 3

    # One resolves, then the whole group; resolving again is a no-op.
    resolved = [am_alert("resolved", "NodeDown", "critical", "node-1:9100")]
    assert sender.post(URL, payload("firing", resolved), format="json").json() == {
        "opened": 0, "updated": 0, "resolved": 1}
    down.refresh_from_db()
    assert down.status == "resolved" and down.ends_at.isoformat().startswith("2026-12-03T18:30:00.5")
    event = AlertEvent.objects.get(alert=down, kind="resolved")
    assert event.actor_name == "integration prod-am"
    all_resolved = [{**alert, "status": "resolved", "endsAt": "2026-12-03T18:40:00Z"} for alert in firing]
    assert sender.post(URL, payload("resolved", all_resolved), format="json").json() == {
        "opened": 0, "updated": 0, "resolved": 2}
    assert sender.post(URL, payload("resolved", all_resolved), format="json").json() == {
        "opened": 0, "updated": 0, "resolved": 0}
    assert not Alert.objects.filter(status__in=["firing", "acknowledged"]).exists()
    assert Notification.objects.filter(alert_status="resolved").count() == 3

    # The same labels firing again: a new episode, a new row.
    assert sender.post(URL, payload("firing", firing[:1]), format="json").json()["opened"] == 1
    assert Alert.objects.count() == 4


def test_labels_not_alertmanagers_fingerprint_decide_identity(sender):
    first = am_alert("firing", "NodeDown", "page", "a", fingerprint="1111111111111111")
    second = am_alert("firing", "NodeDown", "page", "a", fingerprint="2222222222222222")
    assert sender.post(URL, payload("firing", [first, second]), format="json").json() == {
        "opened": 1, "updated": 1, "resolved": 0}
    assert Alert.objects.count() == 1


GOOD = payload("firing", [am_alert("firing", "NodeDown", "critical", "a"),
                          am_alert("firing", "NodeDown", "critical", "b")])


def broken(change) -> dict:
    body = copy.deepcopy(GOOD)
    change(body)
    return body


@pytest.mark.parametrize(("body", "field"), [
    ([GOOD], "detail"),
    ("just text", "detail"),
    (broken(lambda b: b.update(version="3")), "version"),
    (broken(lambda b: b.pop("version")), "version"),
    (broken(lambda b: b.update(alerts={"0": {}})), "alerts"),
    (broken(lambda b: b.pop("alerts")), "alerts"),
    (broken(lambda b: b["alerts"][1].pop("labels")), "alerts"),
    (broken(lambda b: b["alerts"][1].update(labels={})), "alerts"),
    (broken(lambda b: b["alerts"][1].update(labels=["alertname"])), "alerts"),
    (broken(lambda b: b["alerts"][1]["labels"].update(severity=3)), "alerts"),
    (broken(lambda b: b["alerts"][1]["labels"].update({"": "x"})), "alerts"),
    (broken(lambda b: b["alerts"][1]["annotations"].update(summary=None)), "alerts"),
    (broken(lambda b: b["alerts"][1].update(status="pending")), "alerts"),
    (broken(lambda b: b["alerts"][1].update(startsAt="yesterday")), "alerts"),
    (broken(lambda b: b["alerts"][1].update(endsAt=12)), "alerts"),
    (broken(lambda b: b["alerts"][1].update(generatorURL="x" * 1001)), "alerts"),
    (broken(lambda b: b["alerts"].append("NodeDown")), "alerts"),
])
def test_bad_payloads_are_400_naming_the_field_and_write_nothing(sender, body, field):
    answer = sender.post(URL, body, format="json")
    assert answer.status_code == 400, answer.content
    errors = answer.json()
    assert field in errors, errors
    if field == "alerts" and isinstance(errors["alerts"], dict):
        assert set(errors["alerts"]) == {"1"} or set(errors["alerts"]) == {"2"}, errors
    # The first alert was fine: all or nothing, it is not opened either.
    assert not Alert.objects.exists() and Integration.objects.get().last_used_at is None


def test_a_body_that_is_not_json_is_400(sender):
    answer = sender.post(URL, data="{not json", content_type="application/json")
    assert answer.status_code == 400 and not Alert.objects.exists()
