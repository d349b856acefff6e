"""Open alert groups that notified no one for want of a receiver notify as soon as one appears
(created through the API or the console, or a route gaining one), instead of waiting for a new
alert to join; a silenced alert still waits for its silence, and nothing is sent twice.

Real parts: Postgres, Redis, the REST API and console views, the notification tasks (Celery, run
eagerly after each commit, as in test_incidents.py), and a local HTTP webhook receiver
(tests/alerts/conftest.py) that records what arrives.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

import alerts.tasks  # noqa: F401 (registers the tasks enqueued by name, so eager mode runs them here)
from alerts import services
from alerts.models import AlertGroup, Notification, Receiver, Silence
from alerts.routing.dispatch import default_route, groups_notify_waiting
from inferops.celery import app as celery_app

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def eager():
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


def fire(alertname: str, **labels):
    labels = {"alertname": alertname, "severity": "page", **labels}
    return services.alert_raise(labels=labels, annotations={"summary": f"{alertname} firing"}, severity="page",
                                now=timezone.now())


def alertnames(webhook_receiver) -> list[list[str]]:
    return [sorted(a["labels"]["alertname"] for a in r["body"]["alerts"]) for r in webhook_receiver.requests]


def test_the_first_receiver_notifies_the_open_groups_at_once(eager, api, webhook_receiver):
    now = timezone.now()
    Silence.objects.create(matchers=[{"name": "alertname", "value": "Quiet", "isRegex": False, "isEqual": True}],
                           starts_at=now - timedelta(minutes=1), ends_at=now + timedelta(hours=1),
                           created_by="ops", comment="maintenance")
    node_down, quiet = fire("NodeDown"), fire("Quiet")
    # group_wait is 0 in tests: the groups flushed already, to no one (no receiver exists).
    assert not Notification.objects.exists()
    assert AlertGroup.objects.filter(first_notified_at__isnull=True).count() == 2

    answer = api("admin").post("/api/v1/receivers/", {"name": "team", "url": webhook_receiver.url}, format="json")
    assert answer.status_code == 201, answer.content

    # The commit enqueued the task, which notified NodeDown's group through the delivery task.
    assert alertnames(webhook_receiver) == [["NodeDown"]]
    assert Notification.objects.get(alert=node_down).status == "sent"
    assert not Notification.objects.filter(alert=quiet).exists()  # silenced: it waits for the silence's end
    # At least once, never twice: another run (a redelivered task) finds nothing waiting.
    assert groups_notify_waiting() == 0
    assert len(webhook_receiver.requests) == 1


def test_a_receiver_added_in_the_console_notifies_too(eager, client, make_user, webhook_receiver):
    fire("DiskFull")
    client.force_login(make_user("admin"))
    answer = client.post("/alerts/receivers/new/", {"name": "console-hook", "kind": "webhook",
                                                     "url": webhook_receiver.url, "send_resolved": "on",
                                                     "active": "on"})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert alertnames(webhook_receiver) == [["DiskFull"]]


def test_a_route_gaining_a_receiver_notifies_the_groups_that_waited(eager, api, webhook_receiver):
    Receiver.objects.create(name="retired", url="http://127.0.0.1:9/hook", active=False)
    operator = api("operator")
    root = default_route()
    assert operator.patch(f"/api/v1/routes/{root.pk}/", {"receiver": "retired"}, format="json").status_code == 200
    fire("HighLatency")
    # A new receiver the default route does not send to changes nothing: the group still waits.
    answer = api("admin").post("/api/v1/receivers/", {"name": "team", "url": webhook_receiver.url}, format="json")
    assert answer.status_code == 201, answer.content
    assert webhook_receiver.requests == []

    assert operator.patch(f"/api/v1/routes/{root.pk}/", {"receiver": "team"}, format="json").status_code == 200
    assert alertnames(webhook_receiver) == [["HighLatency"]]
    # Saving the route again (same receiver) sends nothing more.
    assert operator.patch(f"/api/v1/routes/{root.pk}/", {"repeat_interval_s": 7200}, format="json").status_code == 200
    assert len(webhook_receiver.requests) == 1
