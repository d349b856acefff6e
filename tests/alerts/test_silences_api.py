"""Silences in Alertmanager's API v2 shape: create, read, list by state, expire; validation with
the field named and nothing written; and a silence mutes the matching alerts (posted through the
Alertmanager endpoint) and only those, until it is expired."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from alerts import services
from alerts.models import AlertEvent, Notification, Receiver, Silence
from alerts.routing.dispatch import groups_advance
from inferops.models import AuditEvent

pytestmark = pytest.mark.django_db

URL = "/api/v1/silences/"


def iso(delta: timedelta = timedelta()) -> str:
    return (timezone.now() + delta).isoformat().replace("+00:00", "Z")


def body(**changes) -> dict:
    return {"matchers": [{"name": "alertname", "value": "NodeDown", "isRegex": False, "isEqual": True},
                         {"name": "instance", "value": "node-1.*", "isRegex": True}],
            "startsAt": iso(), "endsAt": iso(timedelta(hours=2)), "createdBy": "ana",
            "comment": "kernel upgrade on node-1", **changes}


def test_create_read_and_expire_in_alertmanagers_shape(api):
    operator = api("operator")
    created = operator.post(URL, body(), format="json")
    assert created.status_code == 201, created.content
    silence = created.json()
    assert silence["silenceID"] == silence["id"] == str(Silence.objects.get().pk)
    assert set(silence) == {"silenceID", "id", "status", "matchers", "startsAt", "endsAt", "updatedAt", "createdBy",
                            "comment"}
    assert silence["status"] == {"state": "active"} and silence["createdBy"] == "ana"
    # isEqual defaults to true, as in Alertmanager.
    assert silence["matchers"][1] == {"name": "instance", "value": "node-1.*", "isRegex": True, "isEqual": True}
    assert silence["endsAt"].endswith("Z")

    viewer = api("viewer")
    fetched = viewer.get(f"{URL}{silence['id']}/").json()
    assert fetched == {key: value for key, value in silence.items() if key != "silenceID"}
    assert [s["id"] for s in viewer.get(URL).json()] == [silence["id"]]

    expired = operator.delete(f"{URL}{silence['id']}/")
    assert expired.status_code == 200 and expired.json()["status"] == {"state": "expired"}
    assert operator.delete(f"{URL}{silence['id']}/").status_code == 409
    assert operator.delete(f"{URL}99999/").status_code == 404
    assert list(AuditEvent.objects.filter(object_type="alerts.silence").values_list("action", flat=True)
                .order_by("id")) == ["silence.create", "silence.expire"]


def test_viewers_read_operators_write(api):
    assert api("viewer").post(URL, body(), format="json").status_code == 403
    assert api(None).get(URL).status_code == 401
    assert api("viewer").get(URL).status_code == 200
    silence = api("operator").post(URL, body(), format="json").json()
    assert api("viewer").delete(f"{URL}{silence['id']}/").status_code == 403


def test_state_filter_and_order(api):
    operator = api("operator")
    active = operator.post(URL, body(), format="json").json()["id"]
    pending = operator.post(URL, body(startsAt=iso(timedelta(hours=1)), endsAt=iso(timedelta(hours=3))),
                            format="json").json()
    assert pending["status"] == {"state": "pending"}
    gone = operator.post(URL, body(), format="json").json()["id"]
    operator.delete(f"{URL}{gone}/")
    # A pending silence expired now ends before it would have begun, and counts as expired.
    soon = operator.post(URL, body(startsAt=iso(timedelta(hours=1)), endsAt=iso(timedelta(hours=3))),
                         format="json").json()["id"]
    assert operator.delete(f"{URL}{soon}/").json()["status"] == {"state": "expired"}

    def ids(state: str = "") -> list[str]:
        return [s["id"] for s in operator.get(URL, {"state": state} if state else {}).json()]

    assert ids("active") == [active]
    assert ids("pending") == [pending["id"]]
    assert set(ids("expired")) == {gone, soon}
    assert ids() == [active, pending["id"], *ids("expired")]
    answer = operator.get(URL, {"state": "sleeping"})
    assert answer.status_code == 400 and "state" in answer.json()


@pytest.mark.parametrize(("changes", "field"), [
    ({"matchers": []}, "matchers"),
    ({"matchers": "alertname=NodeDown"}, "matchers"),
    ({"matchers": [{"name": "", "value": "x", "isRegex": False}]}, "matchers"),
    ({"matchers": [{"value": "x", "isRegex": False}]}, "matchers"),
    ({"matchers": [{"name": "a", "value": "x", "isRegex": "no"}]}, "matchers"),
    ({"matchers": [{"name": "a", "value": "x", "isRegex": False, "isEqual": 1}]}, "matchers"),
    ({"matchers": [{"name": "a", "value": "(unclosed", "isRegex": True}]}, "matchers"),
    ({"matchers": [{"name": "a", "value": "x", "isRegex": False, "op": "="}]}, "matchers"),
    # Would silence every alert: each matcher holds for a missing label.
    ({"matchers": [{"name": "a", "value": ".*", "isRegex": True}]}, "matchers"),
    ({"matchers": [{"name": "a", "value": "x", "isRegex": False, "isEqual": False}]}, "matchers"),
    ({"endsAt": "tomorrow"}, "endsAt"),
    ({"endsAt": 1}, "endsAt"),
    ({"endsAt": None}, "endsAt"),
    ({"endsAt": iso(-timedelta(minutes=1)), "startsAt": iso(-timedelta(hours=1))}, "endsAt"),
    ({"startsAt": iso(timedelta(hours=3))}, "endsAt"),
    ({"startsAt": "soon"}, "startsAt"),
    ({"comment": ""}, "comment"),
    ({"createdBy": ""}, "createdBy"),
    ({"id": "abc"}, "id"),
])
def test_bad_silences_are_400_naming_the_field(api, changes, field):
    data = body(**changes)
    answer = api("operator").post(URL, data, format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.json(), answer.json()
    assert not Silence.objects.exists() and not AuditEvent.objects.exists()


def test_missing_fields_are_named(api):
    answer = api("operator").post(URL, {}, format="json").json()
    assert {"matchers", "endsAt", "createdBy", "comment"} <= set(answer)


def test_a_start_in_the_past_becomes_now(api):
    silence = api("operator").post(URL, body(startsAt=iso(-timedelta(days=1))), format="json").json()
    assert Silence.objects.get().starts_at > timezone.now() - timedelta(minutes=1)
    assert silence["status"] == {"state": "active"}


def test_a_silence_mutes_matching_alerts_posted_by_alertmanager_only(api):
    receiver = Receiver.objects.create(name="hook", url="http://127.0.0.1:9/hook")
    token = api("admin").post("/api/v1/integrations/", {"name": "prod-am"}, format="json").json()["token"]
    sender = APIClient()
    sender.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    silence = api("operator").post(URL, body(), format="json").json()

    def alert(alertname: str, instance: str) -> dict:
        return {"status": "firing", "labels": {"alertname": alertname, "instance": instance, "severity": "critical"},
                "annotations": {"summary": f"{alertname} {instance}"}, "startsAt": iso(),
                "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "x"}

    posted = {"version": "4", "status": "firing", "receiver": "inferops", "groupKey": "{}:{}", "groupLabels": {},
              "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am:9093",
              "alerts": [alert("NodeDown", "node-1:9100"), alert("NodeDown", "node-2:9100"),
                         alert("DiskFull", "node-1:9100")]}
    assert sender.post("/api/v1/alerts/alertmanager/", posted, format="json").json()["opened"] == 3

    notified = set(Notification.objects.filter(receiver=receiver).values_list("alert__labels__instance",
                                                                              "alert__labels__alertname"))
    assert notified == {("node-2:9100", "NodeDown"), ("node-1:9100", "DiskFull")}
    muted = AlertEvent.objects.get(kind="muted")
    assert muted.alert.labels == {"alertname": "NodeDown", "instance": "node-1:9100", "severity": "critical"}
    assert f"silence {silence['id']}" in muted.text
    # Kept and shown, though: it is firing like the others.
    assert muted.alert.status == "firing"

    # Re-sent while silenced: still no one hears of it.
    sender.post("/api/v1/alerts/alertmanager/", posted, format="json")
    assert Notification.objects.count() == 2

    # Expired: the sweep notifies the alert that is still firing.
    api("operator").delete(f"{URL}{silence['id']}/")
    # Its group (NodeDown) was notified already, so it goes with the group's next news.
    assert services.notify_unmuted() == 1
    groups_advance(timezone.now() + timedelta(seconds=settings.INFEROPS_ALERT_GROUP_INTERVAL_S))
    assert Notification.objects.filter(alert=muted.alert, receiver=receiver, alert_status="firing").exists()


def test_an_update_with_the_same_matchers_changes_the_silence_in_place(api):
    operator = api("operator")
    created = operator.post(URL, body(), format="json").json()
    started = Silence.objects.get().starts_at
    longer = operator.post(URL, body(id=created["id"], startsAt=iso(), endsAt=iso(timedelta(hours=6)),
                                     comment="the upgrade runs long"), format="json")
    assert longer.status_code == 200, longer.content
    assert longer.json()["id"] == created["id"] and longer.json()["comment"] == "the upgrade runs long"
    silence = Silence.objects.get()
    assert silence.starts_at == started  # an active silence keeps its start: no gap opens
    assert silence.ends_at > timezone.now() + timedelta(hours=5)
    assert AuditEvent.objects.filter(action="silence.update").count() == 1


def test_an_update_with_new_matchers_expires_the_silence_and_makes_a_new_one(api):
    operator = api("operator")
    created = operator.post(URL, body(), format="json").json()
    narrower = body(id=created["id"], matchers=[{"name": "instance", "value": "node-1:9100", "isRegex": False}])
    answer = operator.post(URL, narrower, format="json")
    assert answer.status_code == 200 and answer.json()["id"] != created["id"]
    assert operator.get(f"{URL}{created['id']}/").json()["status"] == {"state": "expired"}
    assert answer.json()["status"] == {"state": "active"}
    # An expired silence is history: it cannot be updated; an unknown id is named.
    assert operator.post(URL, body(id=created["id"]), format="json").status_code == 409
    for bad in ("999999", "abc"):
        unknown = operator.post(URL, body(id=bad), format="json")
        assert unknown.status_code == 400 and "id" in unknown.json()
    assert Silence.objects.count() == 2


def test_the_console_edits_a_silence(client, make_user):
    client.force_login(make_user("operator", "ana"))
    silence = Silence.objects.create(
        matchers=[{"name": "alertname", "value": "NodeDown", "isRegex": False, "isEqual": True}],
        starts_at=timezone.now() - timedelta(minutes=5), ends_at=timezone.now() + timedelta(hours=1),
        created_by="ana", comment="maintenance")
    page = client.get(f"/alerts/silences/{silence.pk}/edit/")
    assert page.status_code == 200 and "alertname=&quot;NodeDown&quot;" in page.content.decode()
    saved = client.post(f"/alerts/silences/{silence.pk}/edit/", {
        "matchers": 'alertname="NodeDown"', "starts": "", "ends": "3h", "comment": "maintenance, longer"})
    assert saved.status_code == 302
    silence.refresh_from_db()
    assert silence.comment == "maintenance, longer" and silence.ends_at > timezone.now() + timedelta(hours=2)
    bad = client.post(f"/alerts/silences/{silence.pk}/edit/", {
        "matchers": "alertname", "starts": "", "ends": "3h", "comment": "x"})
    assert bad.status_code == 400 and "is not name=value" in bad.content.decode()
    assert Silence.objects.count() == 1
    client.force_login(make_user("viewer", "val"))
    assert client.get(f"/alerts/silences/{silence.pk}/edit/").status_code == 403
