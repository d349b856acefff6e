"""Issue 29 end to end, receivers: a real Celery worker (with beat) delivers an alert's page to a
PagerDuty Events API v2 receiver and to an email receiver, the on-call acknowledges from the
signed link in the page, and the resolution closes both.

Real parts: the worker process, Postgres, the Redis broker the test process enqueues to (the
worker shares it: notifications are enqueued by this process when its transactions commit), an
SMTP server (aiosmtpd). PagerDuty's endpoint is a local HTTP server standing in for
https://events.pagerduty.com/v2/enqueue (tests/alerts/conftest.py), which answers 202 as PagerDuty
does; nothing leaves the machine.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from alerts import services
from alerts.models import Alert, Delivery, Notification, Receiver
from tests.alerts.conftest import RecordingReceiver
from tests.processes import stop_process
from tests.services import start_worker
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

EXTERNAL = "https://inferops.example"
ROUTING_KEY = "e2eR0UT1NGKEY0123456789abcdef01"


@pytest.fixture
def pagerduty():
    """The stand-in for PagerDuty's events endpoint."""
    stand_in = RecordingReceiver()
    stand_in.script = [(202, 0.0)] * 10
    yield stand_in
    stand_in.close()


def test_page_acknowledged_from_the_signed_link_then_resolved(worker_env, tmp_path, pagerduty,
                                                             smtp_server, settings):
    sink, smtp_port = smtp_server
    settings.INFEROPS_EXTERNAL_URL = EXTERNAL
    Receiver.objects.create(name="pd", kind="pagerduty", url=pagerduty.url, routing_key=ROUTING_KEY)
    Receiver.objects.create(name="oncall-mail", kind="email", to=["oncall@example.com"])
    env = {**worker_env, "SECRET_KEY": settings.SECRET_KEY,  # the worker signs the links this process checks
           "INFEROPS_EXTERNAL_URL": EXTERNAL, "INFEROPS_SLO_EVALUATE_INTERVAL_S": "3600",
           "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend", "EMAIL_HOST": "127.0.0.1",
           "EMAIL_PORT": str(smtp_port), "DEFAULT_FROM_EMAIL": "inferops@example.com"}
    worker = start_worker(env, tmp_path, "oncall")
    log = lambda: (tmp_path / "oncall.log").read_text()[-3000:]  # noqa: E731

    def events(n):
        return lambda: [r["body"] for r in pagerduty.requests] if len(pagerduty.requests) >= n else None

    try:
        alert = services.alert_raise(
            labels={"alertname": "RolloutAborted", "deployment": "chat", "severity": "page"},
            annotations={"summary": "Rollout of chat to v2 aborted", "description": "p99 TTFT 3.1 s > 1 s."},
            severity="page", now=timezone.now())
        [trigger] = wait_until(events(1), lambda: f"a trigger at the stand-in\n{log()}", 60, 0.5)
        dedup_key = trigger["dedup_key"]
        assert (trigger["routing_key"], trigger["event_action"]) == (ROUTING_KEY, "trigger")
        assert trigger["payload"]["summary"] == "Rollout of chat to v2 aborted"
        assert trigger["payload"]["severity"] == "critical" and trigger["payload"]["source"] == "chat"
        assert trigger["client_url"] == f"{EXTERNAL}/alerts/{alert.pk}/"
        [link] = [x["href"] for x in trigger["links"] if x["text"] == "Acknowledge"]
        wait_until(lambda: sink.messages, lambda: f"an email at the SMTP server\n{log()}", 60, 0.5)
        rcpt, message = sink.messages[0]
        assert rcpt == ["oncall@example.com"] and message["Subject"] == "[PAGE] Rollout of chat to v2 aborted"
        # Each message signs its own link, so the two differ when they are sent in different seconds.
        [mailed] = re.findall(r"^Acknowledge: (\S+)", message.get_body(("plain",)).get_content(), re.M)
        ack_prefix = f"{EXTERNAL}/alerts/ack/{alert.pk}:"
        assert link.startswith(ack_prefix) and mailed.startswith(ack_prefix)

        # The on-call taps the link on a phone: no login, one POST.
        response = Client().post(mailed.removeprefix(EXTERNAL))
        assert response.status_code == 200
        assert Alert.objects.get(pk=alert.pk).status == "acknowledged"
        ack = wait_until(events(2), lambda: f"an acknowledge at the stand-in\n{log()}", 60, 0.5)[1]
        assert ack == {"routing_key": ROUTING_KEY, "event_action": "acknowledge", "dedup_key": dedup_key}
        wait_until(lambda: len(sink.messages) == 2, lambda: f"the acknowledgement email\n{log()}", 60, 0.5)
        assert sink.messages[1][1]["Subject"] == "[ACKNOWLEDGED] Rollout of chat to v2 aborted (by signed link)"

        services.alert_resolve(alert=Alert.objects.get(pk=alert.pk), now=timezone.now())
        resolve = wait_until(events(3), lambda: f"a resolve at the stand-in\n{log()}", 60, 0.5)[2]
        assert resolve == {"routing_key": ROUTING_KEY, "event_action": "resolve", "dedup_key": dedup_key}
        wait_until(lambda: len(sink.messages) == 3, lambda: f"the resolution email\n{log()}", 60, 0.5)
        assert sink.messages[2][1]["Subject"] == "[RESOLVED] Rollout of chat to v2 aborted"
        wait_until(lambda: alert.events.filter(kind="notified").count() == 6,
                   lambda: f"six notified events: {list(alert.events.values_list('kind', 'text'))}", 30, 0.5)
    finally:
        stop_process(worker, 30, group=True)

    # Each transition once to each receiver that should hear it.
    assert sorted(Notification.objects.values_list("receiver__name", "alert_status", "status")) == [
        ("oncall-mail", "acknowledged", "sent"), ("oncall-mail", "firing", "sent"), ("oncall-mail", "resolved", "sent"),
        ("pd", "acknowledged", "sent"), ("pd", "firing", "sent"), ("pd", "resolved", "sent")]
    assert Delivery.objects.count() == 6 and len(pagerduty.requests) == 3 and len(sink.messages) == 3
    assert sorted(alert.events.filter(kind="notified").values_list("text", flat=True)) == [
        "acknowledged sent to oncall-mail (email)", "acknowledged sent to pd (pagerduty)",
        "firing sent to oncall-mail (email)", "firing sent to pd (pagerduty)",
        "resolved sent to oncall-mail (email)", "resolved sent to pd (pagerduty)"]


def test_alertmanager_payload_routed_grouped_and_escalated(worker_env, tmp_path, pagerduty, api,
                                                           settings):
    """Alertmanager posts thirteen alerts. Ten disk alerts go to the team's webhook as one grouped
    notification after group_wait, and an eleventh, silenced, to no one. The two node pages go to
    an escalation policy whose first step pages PagerDuty (the local stand-in). One page is
    acknowledged from the signed link in its PagerDuty event and stops there; the other,
    unacknowledged, escalates to step 2 a minute later; resolving it sends `resolve` to everyone
    who was paged."""
    from alerts.models import EscalationPolicy
    from alerts.routing.services import route_save
    from tests.alerts.test_inbound import am_alert, payload

    settings.INFEROPS_EXTERNAL_URL = EXTERNAL
    team, secondary = RecordingReceiver(), RecordingReceiver()
    pd = Receiver.objects.create(name="pd", kind="pagerduty", url=pagerduty.url, routing_key=ROUTING_KEY)
    team_hook = Receiver.objects.create(name="team-hook", url=team.url)
    second = Receiver.objects.create(name="secondary", url=secondary.url)
    policy = EscalationPolicy.objects.create(name="node-oncall")
    policy.steps.create(position=0, after_minutes=0).receivers.set([pd])
    policy.steps.create(position=1, after_minutes=1).receivers.set([second])
    route_save(instance=None, actor=None, fields={
        "matchers": [{"name": "severity", "value": "critical", "op": "="}], "escalation_policy": policy,
        "group_by": ["alertname", "instance"], "group_wait_s": 0})
    route_save(instance=None, actor=None, fields={
        "matchers": [{"name": "alertname", "value": "Disk.*", "op": "=~"}], "receiver": team_hook,
        "group_by": ["alertname"], "group_wait_s": 3})
    token = api("admin").post("/api/v1/integrations/", {"name": "prod-am"}, format="json").json()["token"]
    sender = Client(headers={"authorization": f"Bearer {token}"})
    env = {**worker_env, "SECRET_KEY": settings.SECRET_KEY, "INFEROPS_EXTERNAL_URL": EXTERNAL,
           "INFEROPS_SLO_EVALUATE_INTERVAL_S": "3600", "INFEROPS_ALERT_TICK_S": "1"}
    worker = start_worker(env, tmp_path, "routing")
    log = lambda: (tmp_path / "routing.log").read_text()[-3000:]  # noqa: E731
    disks = [am_alert("firing", "DiskFilling", "warning", f"node-{i}:9100") for i in range(10)]
    # An eleventh disk alert is silenced: kept and shown, notified to no one.
    silenced = am_alert("firing", "DiskFilling", "warning", "node-x:9100")
    silence = api("operator").post("/api/v1/silences/", {
        "matchers": [{"name": "instance", "value": "node-x:9100", "isRegex": False}],
        "endsAt": (timezone.now() + timedelta(hours=1)).isoformat(), "createdBy": "ops",
        "comment": "disk swap on node-x"}, format="json")
    assert silence.status_code == 201, silence.content
    pages = [am_alert("firing", "NodeDown", "critical", f"node-{x}:9100") for x in "ab"]

    def post(status, alerts):
        answer = sender.post("/api/v1/alerts/alertmanager/", payload(status, alerts), content_type="application/json")
        assert answer.status_code == 200, answer.content

    try:
        post("firing", [*disks, silenced, *pages])
        post("firing", [*disks, silenced, *pages])  # Alertmanager re-sends: deduplicated
        triggers = wait_until(lambda: [r["body"] for r in pagerduty.requests] if len(pagerduty.requests) >= 2 else None,
                              lambda: f"PagerDuty triggers\n{log()}", 60, 0.5)
        # Grouped by instance: each page is its own group, so its own PagerDuty incident.
        by_instance = {t["payload"]["custom_details"]["common_labels"]["instance"]: t for t in triggers}
        assert set(by_instance) == {"node-a:9100", "node-b:9100"}
        assert {t["event_action"] for t in triggers} == {"trigger"}

        # Ten disk alerts, one group: one notification carrying all ten, once.
        [grouped] = wait_until(lambda: team.requests, lambda: f"a grouped notification\n{log()}", 30, 0.5)
        assert grouped["body"]["groupLabels"] == {"alertname": "DiskFilling"}
        assert sorted(a["labels"]["instance"] for a in grouped["body"]["alerts"]) == sorted(
            a["labels"]["instance"] for a in disks)

        # node-a is acknowledged from the link in its PagerDuty event: PagerDuty hears it.
        [link] = [x["href"] for x in by_instance["node-a:9100"]["links"] if x["text"] == "Acknowledge"]
        assert Client().post(link.removeprefix(EXTERNAL)).status_code == 200
        ack = wait_until(lambda: [r["body"] for r in pagerduty.requests[2:]], lambda: f"an acknowledge\n{log()}",
                         30, 0.5)
        assert ack == [{"routing_key": ROUTING_KEY, "event_action": "acknowledge",
                        "dedup_key": by_instance["node-a:9100"]["dedup_key"]}]

        # node-b stays unacknowledged: a minute after the page, step 2 notifies the secondary.
        [escalated] = wait_until(lambda: secondary.requests, lambda: f"an escalation to step 2\n{log()}", 90, 0.5)
        assert [a["labels"]["instance"] for a in escalated["body"]["alerts"]] == ["node-b:9100"]

        post("resolved", [am_alert("resolved", "NodeDown", "critical", "node-b:9100")])
        resolve = wait_until(lambda: [r["body"] for r in pagerduty.requests[3:]], lambda: f"a resolve\n{log()}",
                             30, 0.5)
        assert resolve == [{"routing_key": ROUTING_KEY, "event_action": "resolve",
                            "dedup_key": by_instance["node-b:9100"]["dedup_key"]}]
        wait_until(lambda: len(secondary.requests) == 2, lambda: f"the resolution at the secondary\n{log()}", 30, 0.5)
        assert secondary.requests[1]["body"]["status"] == "resolved"
        time.sleep(3)  # a few more ticks: nothing else goes out
    finally:
        stop_process(worker, 30, group=True)
        team.close()
        secondary.close()

    assert len(team.requests) == 1 and len(pagerduty.requests) == 4 and len(secondary.requests) == 2
    node_a = Alert.objects.get(labels__instance="node-a:9100")
    assert sorted(Notification.objects.filter(alert=node_a).values_list("receiver__name", "alert_status", "round")) \
        == [("pd", "acknowledged", 0), ("pd", "firing", 0)]  # acknowledged: never escalated
    assert not Notification.objects.exclude(status="sent").exists()
    muted = Alert.objects.get(labels__instance="node-x:9100")
    assert muted.status == "firing" and not muted.notifications.exists()
    assert "silenced by silence" in muted.events.get(kind="muted").text
