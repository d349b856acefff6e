"""Every link the platform sends resolves. A scenario makes it notify every receiver kind of every
kind of alert it raises or takes in: an SLO's page and ticket firing, acknowledged on the console
and resolved; an aborted rollout; a degraded deployment; Alertmanager alerts posted with and
without a generatorURL (and with one that is no link). Each URL in each message that was sent
(webhook bodies, Slack payloads, PagerDuty events, emails as text and HTML) is then opened with a
signed-in console client: each console link answers 200, at once or after redirects, and the only
links elsewhere are the runbook and the generatorURL the scenario itself supplied.

Real parts: Postgres, Redis, the notification tasks (run eagerly, after each commit), HTTP servers
standing in for the webhook, Slack and PagerDuty endpoints (PagerDuty's and Slack's are outside
this machine), and an SMTP server (aiosmtpd).
"""

from __future__ import annotations

import html
import re
from urllib.parse import urlsplit

import pytest
from django.test import Client
from django.utils import timezone

import alerts.tasks  # noqa: F401 (registers the tasks enqueued by name, so eager mode runs them here)
from alerts.models import Alert, Notification, Receiver
from deployments.models import Rollout
from deployments.rollouts.machine import abort, resolve_abort_alerts
from inferops.celery import app as celery_app
from slo.budget import MINUTE
from slo.evaluation import evaluate_slos
from slo.services import slo_create
from tests.alerts.conftest import RecordingReceiver
from tests.slo.conftest import NOW, event, insert_events, make_deployment

pytestmark = pytest.mark.django_db(transaction=True)

EXTERNAL = "https://inferops.example"
RUNBOOK = "https://runbooks.example/chat-ttft"
PROMETHEUS_GRAPH = "http://prometheus.example:9090/graph?g0.expr=up+%3D%3D+0&g0.tab=1"
# A URL ends at whitespace, a quote, an angle bracket or Slack's `|` (in `<url|text>`).
URL = re.compile(r"https?://[^\s\"'<>|]+")


@pytest.fixture
def endpoints(settings, smtp):
    """One receiver of each kind on the default route, each on a real server."""
    settings.INFEROPS_EXTERNAL_URL = EXTERNAL
    servers = {kind: RecordingReceiver() for kind in ("webhook", "slack", "pagerduty")}
    servers["pagerduty"].script = [(202, 0.0)] * 100  # PagerDuty answers 202
    Receiver.objects.create(name="hook", kind="webhook", url=servers["webhook"].url)
    Receiver.objects.create(name="chat", kind="slack", url=servers["slack"].url)
    Receiver.objects.create(name="pd", kind="pagerduty", url=servers["pagerduty"].url,
                            routing_key="R0UT1NGKEY0123456789abcdef012345")
    Receiver.objects.create(name="oncall-mail", kind="email", to=["oncall@example.com"])
    celery_app.conf.task_always_eager = True
    yield servers, smtp
    celery_app.conf.task_always_eager = False
    for server in servers.values():
        server.close()


def strings(value):
    """Every string in a JSON document."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def sent_urls(servers, sink) -> dict[str, set[str]]:
    """URL -> where it was seen ("webhook", "slack", "pagerduty", "email")."""
    found: dict[str, set[str]] = {}
    for kind, server in servers.items():
        for request in server.requests:
            for text in strings(request["body"]):
                for url in URL.findall(text):
                    found.setdefault(url, set()).add(kind)
    for _, message in sink.messages:
        for part in ("plain", "html"):
            for url in URL.findall(html.unescape(message.get_body((part,)).get_content())):
                found.setdefault(url, set()).add("email")
    return found


def slow_minute(minute, total=40, slow=20):
    insert_events([event(minute, ttft_ms=2000.0 if i < slow else 100.0) for i in range(total)])


def am_alert(status: str, alertname: str, instance: str, **extra) -> dict:
    return {"status": status, "labels": {"alertname": alertname, "severity": "critical", "instance": instance},
            "annotations": {"summary": f"{alertname} on {instance}"}, "startsAt": "2026-03-10T11:58:00Z",
            "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-03-10T12:10:00Z", **extra}


def test_every_link_in_every_notification_sent_resolves(endpoints, api, make_user):
    servers, sink = endpoints
    operator = Client()
    operator.force_login(make_user("operator"))

    # An SLO burns: its page and ticket open (the ticket inhibited by the page, then notified once
    # the page resolves); the page is acknowledged on the console, then resolves.
    deployment = make_deployment("chat")
    slo = slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=500.0,
                     objective=0.99, window="1d", runbook_url=RUNBOOK)
    slow_minute(NOW - MINUTE)
    slow_minute(NOW)
    evaluate_slos(now=NOW)
    page = Alert.objects.get(slo=slo, severity="page")
    assert operator.post(f"/alerts/{page.pk}/acknowledge/").status_code == 302
    insert_events([event(NOW + 2 * MINUTE, ttft_ms=100.0) for _ in range(40)])
    evaluate_slos(now=NOW + 2 * MINUTE)
    assert Alert.objects.get(pk=page.pk).status == "resolved"

    # A rollout is aborted (its alert links the rollout's page), then the deployment is healthy again.
    now = timezone.now()
    rollout = Rollout.objects.create(deployment=deployment, stable_version=deployment.version,
                                     candidate_version=deployment.version, step_started_at=now)
    abort(rollout, now, "p99 TTFT 3.1 s > 1 s")
    resolve_abort_alerts(deployment, now)

    # The deployment is degraded by hand (its alert links the deployment's page).
    admin = api("operator")
    policy = {"enabled": True, "window": "5m", "hold_s": 60, "slos": [], "levels": [
        {"name": "shed-batch", "enter_burn_rate": 5, "exit_burn_rate": 2, "actions": {"shed_below_priority": 5}}]}
    assert admin.put("/api/v1/deployments/chat/degradation/", policy, format="json").status_code == 200
    forced = admin.post("/api/v1/deployments/chat/degradation/override/",
                        {"level": 1, "until": "30m", "reason": "launch"}, format="json")
    assert forced.status_code == 200, forced.content

    # An outside Alertmanager posts three alerts: one with Prometheus's generatorURL, one without
    # any, one with a generatorURL that is no link; then resolves them.
    token = api("admin").post("/api/v1/integrations/", {"name": "prod-am"}, format="json").json()["token"]
    alertmanager = Client(headers={"authorization": f"Bearer {token}"})
    posted = [am_alert("firing", "NodeDown", "node-a:9100", generatorURL=PROMETHEUS_GRAPH),
              am_alert("firing", "DiskFilling", "node-b:9100"),
              am_alert("firing", "ClockSkew", "node-c:9100", generatorURL="javascript:alert(1)")]
    for status, batch in (("firing", posted), ("resolved", [{**a, "status": "resolved"} for a in posted])):
        answer = alertmanager.post("/api/v1/alerts/alertmanager/", {
            "version": "4", "status": status, "receiver": "inferops", "groupKey": "{}:{}", "alerts": batch,
            "externalURL": "http://alertmanager.example:9093"}, content_type="application/json")
        assert answer.status_code == 200, answer.content

    # Everything was delivered, to every receiver kind.
    assert not Notification.objects.exclude(status="sent").exists()
    kinds = set(Notification.objects.values_list("receiver__kind", flat=True))
    assert kinds == {"webhook", "slack", "pagerduty", "email"}
    alertnames = set(Notification.objects.values_list("alert__labels__alertname", flat=True))
    assert alertnames == {"SloErrorBudgetBurn", "RolloutAborted", "DeploymentDegraded", "NodeDown", "DiskFilling",
                          "ClockSkew"}, alertnames

    found = sent_urls(servers, sink)
    viewer = Client()
    viewer.force_login(make_user("viewer"))
    broken = {}
    for url, seen_in in sorted(found.items()):
        if not url.startswith(EXTERNAL):
            continue
        parts = urlsplit(url)
        response = viewer.get(parts.path or "/", query_params=parts.query or None, follow=True)
        if response.status_code != 200:
            broken[url] = (response.status_code, sorted(seen_in))
    assert not broken, broken
    # The only links elsewhere are those the scenario supplied: the SLO's runbook and Prometheus's
    # graph, passed through as posted.
    assert {url for url in found if not url.startswith(EXTERNAL)} == {RUNBOOK, PROMETHEUS_GRAPH}

    # Where each alert was raised, in the webhook payloads: the SLO's page by id, the rollout's and
    # the deployment's pages in their annotations, the alert's own page where nothing else says.
    generators = {(a["labels"]["alertname"], a["labels"].get("severity")): a["generatorURL"]
                  for request in servers["webhook"].requests for a in request["body"]["alerts"]}
    alert_of = {name: Alert.objects.get(labels__alertname=name)
                for name in ("DiskFilling", "ClockSkew")}
    assert generators[("SloErrorBudgetBurn", "page")] == f"{EXTERNAL}/slos/{slo.pk}/"
    assert generators[("NodeDown", "critical")] == PROMETHEUS_GRAPH
    assert generators[("DiskFilling", "critical")] == f"{EXTERNAL}/alerts/{alert_of['DiskFilling'].pk}/"
    assert generators[("ClockSkew", "critical")] == f"{EXTERNAL}/alerts/{alert_of['ClockSkew'].pk}/"
    # Nor does the alert's page offer a posted generatorURL that is no link as "where it was raised".
    assert 'href="javascript:' not in viewer.get(f"/alerts/{alert_of['ClockSkew'].pk}/").content.decode()
    assert f"{EXTERNAL}/deployments/chat/rollouts/{rollout.pk}/" in found
    assert f"{EXTERNAL}/deployments/chat/" in found
    # The signed acknowledgement link went out, to every receiver kind that carries one.
    acks = {url: seen for url, seen in found.items() if "/alerts/ack/" in url}
    assert acks and set().union(*acks.values()) == {"slack", "pagerduty", "email"}
