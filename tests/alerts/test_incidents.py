"""A burst of one group is one PagerDuty incident, as with Alertmanager's own PagerDuty integration
(its dedup key is the group key): ten alerts of one group posted by an outside Alertmanager make
one trigger with one dedup_key, another group its own; alerts joining update the same incident;
acknowledging any alert of the group acknowledges the incident once; it resolves once every alert
of the group has. Per-alert incidents stay a receiver option. Slack, email and webhook receivers
send one message per group for the same burst.

Real parts: Postgres, Redis, the Alertmanager endpoint with an integration token, the routing
beat (`groups_advance`, driven with explicit times), the notification tasks (Celery, run eagerly
after each commit), an SMTP server (aiosmtpd). PagerDuty's Events API v2 and Slack are outside
this machine: a local HTTP server stands in for each (tests/alerts/conftest.py), recording what a
real endpoint would receive.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

import alerts.tasks  # noqa: F401 (registers the tasks enqueued by name, so eager mode runs them here)
from alerts import services
from alerts.models import Alert, AlertGroup, Notification, Receiver
from alerts.routing.dispatch import default_route, group_key, groups_advance
from alerts.routing.services import route_save
from inferops.celery import app as celery_app
from tests.alerts.conftest import RecordingReceiver
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

EXTERNAL = "https://inferops.example"
ROUTING_KEY = "R0UT1NGKEY0123456789abcdef012345"
GROUP_WAIT = timedelta(seconds=30)
GROUP_INTERVAL = timedelta(seconds=300)


@pytest.fixture
def eager(settings):
    """Tasks run in this process right after each commit; the default route waits 30 s to gather a
    new group's alerts (Alertmanager's default group_wait) and groups by alertname."""
    settings.INFEROPS_EXTERNAL_URL = EXTERNAL
    route_save(instance=default_route(), actor=None, fields={
        "group_by": ["alertname"], "group_wait_s": 30, "group_interval_s": 300})
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@pytest.fixture
def servers():
    """HTTP servers standing in for PagerDuty's Events API and Slack (unreachable from here) and a webhook."""
    made = {kind: RecordingReceiver() for kind in ("pagerduty", "slack", "webhook")}
    made["pagerduty"].script = [(202, 0.0)] * 200  # PagerDuty answers 202 Accepted
    yield made
    for server in made.values():
        server.close()


@pytest.fixture
def alertmanager(api):
    token = api("admin").post("/api/v1/integrations/", {"name": "prod-am"}, format="json").json()["token"]
    client = Client(headers={"authorization": f"Bearer {token}"})

    def post(status: str, alerts: list[dict]) -> None:
        answer = client.post("/api/v1/alerts/alertmanager/", {
            "version": "4", "status": status, "receiver": "inferops", "groupKey": "{}:{}", "alerts": alerts,
            "externalURL": "http://alertmanager.example:9093"}, content_type="application/json")
        assert answer.status_code == 200, answer.content

    return post


def am_alert(alertname: str, instance: str, status: str = "firing") -> dict:
    return {"status": status, "labels": {"alertname": alertname, "severity": "critical", "instance": instance},
            "annotations": {"summary": f"{alertname} on {instance}", "runbook_url": "https://runbooks.example/node"},
            "startsAt": "2026-03-10T11:58:00Z",
            "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-03-10T12:10:00Z"}


def burst(alertname: str, count: int, status: str = "firing", first: int = 0) -> list[dict]:
    return [am_alert(alertname, f"node-{i}", status) for i in range(first, first + count)]


def pagerduty_receiver(server: RecordingReceiver, **fields) -> Receiver:
    return Receiver.objects.create(name="pd", kind="pagerduty", url=server.url, routing_key=ROUTING_KEY, **fields)


def events(server: RecordingReceiver, since: int = 0) -> list[dict]:
    return [request["body"] for request in server.requests[since:]]


def alert(alertname: str, instance: str) -> Alert:
    return Alert.objects.get(labels__alertname=alertname, labels__instance=instance)


def test_a_burst_of_one_group_is_one_pagerduty_incident(eager, servers, alertmanager, make_user):
    pagerduty = servers["pagerduty"]
    pagerduty_receiver(pagerduty)
    alertmanager("firing", burst("NodeDown", 10) + burst("DiskFull", 2))
    start = timezone.now()  # the groups' group_wait runs from their first alert, posted just now
    assert pagerduty.requests == []  # gathering the groups: group_wait
    groups_advance(start + GROUP_WAIT)

    # One trigger per group, each with its own dedup_key: two incidents, not twelve.
    triggers = {event["payload"]["class"]: event for event in events(pagerduty)}
    assert [event["event_action"] for event in events(pagerduty)] == ["trigger", "trigger"]
    assert set(triggers) == {"NodeDown", "DiskFull"}
    node_down, disk_full = triggers["NodeDown"], triggers["DiskFull"]
    assert node_down["dedup_key"] != disk_full["dedup_key"]
    # The key is the route's and the group labels': stable for as long as the route and labels are.
    assert node_down["dedup_key"] == f"inferops-group-{group_key(default_route(), {'alertname': 'NodeDown'})}"
    details = node_down["payload"]["custom_details"]
    assert details["num_firing"] == 10 and details["group_labels"] == {"alertname": "NodeDown"}
    assert details["common_labels"] == {"alertname": "NodeDown", "severity": "critical"}
    assert [a["labels"]["instance"] for a in details["firing"]] == [f"node-{i}" for i in range(10)]
    assert details["firing"][3]["url"] == f"{EXTERNAL}/alerts/{alert('NodeDown', 'node-3').pk}/"
    assert node_down["payload"]["summary"] == "NodeDown on node-0 (and 9 more)"
    assert (node_down["payload"]["severity"], node_down["payload"]["source"]) == ("critical", "inferops")
    assert disk_full["payload"]["custom_details"]["num_firing"] == 2
    [ack_link] = [link["href"] for link in node_down["links"] if link["text"] == "Acknowledge"]
    assert {"href": "https://runbooks.example/node", "text": "Runbook"} in node_down["links"]

    # Alertmanager re-sends the group with one more alert: the same incident is updated after
    # group_interval (a trigger with the same dedup_key, the details now listing eleven).
    alertmanager("firing", burst("NodeDown", 11))
    groups_advance(start + GROUP_WAIT + GROUP_INTERVAL)
    [update] = events(pagerduty, 2)
    assert (update["event_action"], update["dedup_key"]) == ("trigger", node_down["dedup_key"])
    assert update["payload"]["custom_details"]["num_firing"] == 11
    assert update["payload"]["summary"] == "NodeDown on node-0 (and 10 more)"

    # Acknowledging any alert of the group, on the console, acknowledges its incident: once.
    operator = Client()
    operator.force_login(make_user("operator"))
    assert operator.post(f"/alerts/{alert('NodeDown', 'node-3').pk}/acknowledge/").status_code == 302
    assert events(pagerduty, 3) == [{"routing_key": ROUTING_KEY, "event_action": "acknowledge",
                                     "dedup_key": node_down["dedup_key"]}]
    # Another alert of the group acknowledged through the signed link: the incident already is.
    assert Client().post(f"/alerts/ack/{services.ack_token(alert('NodeDown', 'node-5'))}/").status_code == 200
    assert alert("NodeDown", "node-5").status == "acknowledged" and len(pagerduty.requests) == 4
    # The trigger's own link acknowledges too (node-0 is the incident's first alert).
    assert Client().post(ack_link.removeprefix(EXTERNAL)).status_code == 200
    assert alert("NodeDown", "node-0").status == "acknowledged" and len(pagerduty.requests) == 4

    # One alert of eleven resolves: the incident stays open.
    alertmanager("resolved", burst("NodeDown", 1, "resolved"))
    assert alert("NodeDown", "node-0").status == "resolved" and len(pagerduty.requests) == 4
    # The rest resolve: one resolve, for the group's incident, and none for the other group's.
    alertmanager("resolved", burst("NodeDown", 10, "resolved", first=1))
    assert events(pagerduty, 4) == [{"routing_key": ROUTING_KEY, "event_action": "resolve",
                                     "dedup_key": node_down["dedup_key"]}]
    resolved = Notification.objects.filter(receiver__name="pd", alert_status="resolved")
    assert resolved.count() == 11 and set(resolved.values_list("status", flat=True)) == {"sent"}
    assert alert("NodeDown", "node-7").events.filter(
        kind="notified", text="resolved sent to pd (pagerduty) with 10 other alerts").exists()
    alertmanager("resolved", burst("DiskFull", 2, "resolved"))
    assert events(pagerduty, 5) == [{"routing_key": ROUTING_KEY, "event_action": "resolve",
                                     "dedup_key": disk_full["dedup_key"]}]

    # The problem comes back: the same key again, which PagerDuty opens as a new incident (a
    # trigger after a resolve never reopens one).
    later = start + timedelta(hours=1)
    alertmanager("firing", burst("NodeDown", 1))
    groups_advance(later)
    [again] = events(pagerduty, 6)
    assert (again["event_action"], again["dedup_key"]) == ("trigger", node_down["dedup_key"])
    assert again["payload"]["custom_details"]["num_firing"] == 1 and again["payload"]["summary"] == "NodeDown on node-0"
    assert AlertGroup.objects.filter(labels={"alertname": "NodeDown"}).count() == 1


def waiting_on_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0]


def test_the_last_two_alerts_resolving_at_once_resolve_the_incident(eager, servers, alertmanager):
    """Two transactions resolve the group's last two alerts at once: each sees the other still open
    until it commits, so without the group row's lock neither would resolve the incident."""
    pagerduty = servers["pagerduty"]
    pagerduty_receiver(pagerduty)
    alertmanager("firing", burst("NodeDown", 2))
    groups_advance(timezone.now() + GROUP_WAIT)
    [trigger] = events(pagerduty)
    first, second = alert("NodeDown", "node-0"), alert("NodeDown", "node-1")
    holding, release, failures = threading.Event(), threading.Event(), []

    def resolve(target: Alert, hold: bool) -> None:
        try:
            with transaction.atomic():
                services.alert_resolve(alert=target, now=timezone.now())
                if hold:  # keep the transaction open until the other one waits on it
                    holding.set()
                    release.wait(10)
        except Exception as exc:  # noqa: BLE001 (reported by the test's thread)
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=resolve, args=(first, True))]
    threads[0].start()
    assert holding.wait(10)
    threads.append(threading.Thread(target=resolve, args=(second, False)))
    threads[1].start()
    # Either it waits for the first (the group row's lock), or it ran through seeing node-0 open.
    wait_until(lambda: waiting_on_locks() == 1 or not threads[1].is_alive(),
               "the second resolution to wait on the group's lock, or to end")
    release.set()
    for thread in threads:
        thread.join(10)
    assert not failures and not any(thread.is_alive() for thread in threads)
    assert events(pagerduty, 1) == [{"routing_key": ROUTING_KEY, "event_action": "resolve",
                                     "dedup_key": trigger["dedup_key"]}]


def test_per_alert_incidents_stay_a_receiver_option(eager, servers, alertmanager, make_user):
    pagerduty = servers["pagerduty"]
    pagerduty_receiver(pagerduty, incident_per="alert")
    alertmanager("firing", burst("NodeDown", 10))
    start = timezone.now()
    groups_advance(start + GROUP_WAIT)
    triggers = events(pagerduty)
    assert [event["event_action"] for event in triggers] == ["trigger"] * 10
    assert len({event["dedup_key"] for event in triggers}) == 10
    node_3 = alert("NodeDown", "node-3")
    [key_3] = [event["dedup_key"] for event in triggers if event["payload"]["source"] == "node-3"]
    assert key_3 == f"inferops-{node_3.fingerprint}-{node_3.pk}"

    services.alert_acknowledge(alert=node_3, actor_name="signed link")
    assert [(e["event_action"], e["dedup_key"]) for e in events(pagerduty, 10)] == [("acknowledge", key_3)]
    alertmanager("resolved", [am_alert("NodeDown", "node-3", "resolved")])
    assert [(e["event_action"], e["dedup_key"]) for e in events(pagerduty, 11)] == [("resolve", key_3)]


def test_slack_email_and_webhook_send_one_message_per_group(eager, servers, alertmanager, smtp):
    Receiver.objects.create(name="hook", kind="webhook", url=servers["webhook"].url)
    Receiver.objects.create(name="chat", kind="slack", url=servers["slack"].url)
    Receiver.objects.create(name="oncall-mail", kind="email", to=["oncall@example.com"])
    alertmanager("firing", burst("NodeDown", 10) + burst("DiskFull", 2))
    start = timezone.now()  # the groups' group_wait runs from their first alert, posted just now
    groups_advance(start + GROUP_WAIT)

    # Firing: one message per group to each, listing the group's alerts.
    hooks = sorted(events(servers["webhook"]), key=lambda body: -len(body["alerts"]))
    assert [(body["groupLabels"], len(body["alerts"])) for body in hooks] == [
        ({"alertname": "NodeDown"}, 10), ({"alertname": "DiskFull"}, 2)]
    chats = sorted(body["text"] for body in events(servers["slack"]))
    assert [re.sub(r"node-\d+", "node-N", text) for text in chats] == [
        "[PAGE:10] NodeDown on node-N (and 9 more)", "[PAGE:2] DiskFull on node-N (and 1 more)"]
    assert sorted(message["subject"] for _, message in smtp.messages) == chats

    # One alert acknowledged: one message to each receiver that takes acknowledgements.
    services.alert_acknowledge(alert=alert("NodeDown", "node-3"), actor_name="signed link")
    assert [body["text"] for body in events(servers["slack"], 2)] == [
        "[ACKNOWLEDGED] NodeDown on node-3 (by signed link)"]
    assert len(smtp.messages) == 3 and len(servers["webhook"].requests) == 2

    # Everything resolves in one payload: one message per group again.
    alertmanager("resolved", burst("NodeDown", 10, "resolved") + burst("DiskFull", 2, "resolved"))
    hooks = sorted(events(servers["webhook"], 2), key=lambda body: -len(body["alerts"]))
    assert [(body["status"], body["groupLabels"], len(body["alerts"])) for body in hooks] == [
        ("resolved", {"alertname": "NodeDown"}, 10), ("resolved", {"alertname": "DiskFull"}, 2)]
    assert sorted(re.sub(r"node-\d+", "node-N", body["text"]) for body in events(servers["slack"], 3)) == [
        "[RESOLVED:10] NodeDown on node-N (and 9 more)", "[RESOLVED:2] DiskFull on node-N (and 1 more)"]
    assert len(smtp.messages) == 5
