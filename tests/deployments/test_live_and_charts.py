"""The deployment page's live endpoint, its error-rate series from the usage ledger (shed and
no-replica failures included, per rollout track) and the events its charts mark."""

from __future__ import annotations

from datetime import timedelta
from itertools import count

import pytest
from django.utils import timezone

from alerts.models import Alert
from deployments.choices import ReplicaState
from deployments.models import Deployment, Replica, ReplicaMetricsMinute, Rollout
from deployments.replicas.metrics_query import deployment_error_rate, deployment_events, deployment_series
from inferops.audit import audit_record
from registry.models import RegisteredModel
from tenants.models import UsageEvent
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db

# A whole minute, half an hour ago: inside every retention, and steps fall on minute boundaries.
T0 = (timezone.now() - timedelta(minutes=30)).replace(second=0, microsecond=0)
_ids = count()


@pytest.fixture
def chat():
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1, v2 = make_version(model, 1), make_version(model, 2)
    deployment = Deployment.objects.create(name="chat", model=model, version=v1, replicas=2,
                                           status="progressing", status_message="1/2 replicas of v1 ready")
    first = Replica.objects.create(deployment=deployment, version=v1, node="test", url="http://127.0.0.1:9/1",
                                   state=ReplicaState.READY)
    second = Replica.objects.create(deployment=deployment, version=v1, node="test", url="http://127.0.0.1:9/2",
                                    state=ReplicaState.STARTING)
    Replica.objects.create(deployment=deployment, version=v1, node="test", state=ReplicaState.STOPPED)
    return deployment, (v1, v2), (first, second)


def event(at_s: float, replica, *, status: int = 200, error_kind: str | None = None, deployment: str = "chat",
          **fields) -> UsageEvent:
    return UsageEvent.objects.create(
        request_id=f"req-{next(_ids)}", time=T0 + timedelta(seconds=at_s), deployment=deployment,
        replica=replica.pk if replica else None, endpoint="chat", e2e_ms=100.0, status=status,
        error_kind=error_kind, **fields)


# ---------------------------------------------------------------------------- live endpoint


def test_live_state_follows_the_replica_rows(client, make_user, chat):
    deployment, _, (first, second) = chat
    client.force_login(make_user("viewer"))
    body = client.get("/deployments/chat/live/").json()
    assert {k: body[k] for k in ("status", "ready_replicas", "replicas", "up_to_date", "version", "paused")} == {
        "status": "progressing", "ready_replicas": 1, "replicas": 2, "up_to_date": False, "version": 1,
        "paused": False}
    assert body["status_message"] == "1/2 replicas of v1 ready"
    assert [(r["id"], r["state"]) for r in body["replica_rows"]] == [(second.pk, "starting"), (first.pk, "ready")]

    # The second replica turns ready and the reconciler writes the status: the next poll says 2 / 2.
    started = timezone.now()
    Replica.objects.filter(pk=second.pk).update(state=ReplicaState.READY, started_at=started, restarts=1,
                                                last_error="exited with code 137")
    Deployment.objects.filter(pk=deployment.pk).update(status="ready", status_message="")
    body = client.get("/deployments/chat/live/").json()
    assert (body["status"], body["ready_replicas"], body["up_to_date"]) == ("ready", 2, True)
    assert body["status_message"] == ""
    row = body["replica_rows"][0]
    assert row["restarts"] == 1 and row["last_error"] == "exited with code 137"
    assert row["started"] == timezone.localtime(started).strftime("%H:%M:%S")

    assert len(client.get("/deployments/chat/live/?replicas=all").json()["replica_rows"]) == 3
    assert client.get("/deployments/nope/live/").status_code == 404


def test_live_state_needs_a_login(client, chat):
    response = client.get("/deployments/chat/live/")
    assert response.status_code == 302 and "/login/" in response["Location"]


def test_page_renders_the_same_figures_without_javascript(client, make_user, chat):
    client.force_login(make_user("viewer"))
    html = client.get("/deployments/chat/").content.decode()
    assert 'id="ready">1 / 2<' in html and 'data-url="/deployments/chat/live/"' in html
    assert 'id="chart-error_rate"' in html


# ---------------------------------------------------------------------------- error rate


def test_error_rate_counts_shed_and_no_replica_failures(chat):
    deployment, _, (first, _) = chat
    for second in range(3):
        event(second, first)
    event(4, None, status=503, error_kind="shed")  # no replica ready: shed before one was chosen
    event(5, None, status=502, error_kind="upstream_connect", failed_replica=first.pk)  # every attempt failed
    event(6, None, status=429, error_kind="rate_limited")  # the client's doing: a request, not a failure
    event(7, None, status=503, error_kind="degraded")  # shed on purpose by the degradation policy
    event(8, first, status=500)
    event(9, first, deployment="other", status=500)  # another deployment's

    result = deployment_error_rate(deployment, T0, T0 + timedelta(minutes=2), 60)
    assert result["counts"][0][1:] == [8, 3, 2]  # requests, failed, failed before a replica
    assert result["points"] == [[T0.isoformat(), 0.375], [(T0 + timedelta(minutes=1)).isoformat(), None]]
    assert result["tracks"] == {}  # no rollout: no tracks


def test_error_rate_per_rollout_track(chat):
    deployment, (v1, v2), (first, _) = chat
    rollout = Rollout.objects.create(deployment=deployment, stable_version=v1, candidate_version=v2,
                                     step_started_at=T0, weight=50)
    Rollout.objects.filter(pk=rollout.pk).update(created_at=T0 + timedelta(minutes=1))
    candidate = Replica.objects.create(deployment=deployment, version=v2, node="test", rollout=rollout,
                                       state=ReplicaState.READY)
    event(10, first, status=500)  # before the rollout: the deployment's line only
    event(70, first)
    event(71, first)
    event(72, candidate, status=502, error_kind="upstream_error")
    event(73, None, status=503, error_kind="shed")  # no track: the deployment's line still counts it

    result = deployment_error_rate(deployment, T0, T0 + timedelta(minutes=2), 60)
    assert [value for _, value in result["points"]] == [1.0, 0.5]
    assert [value for _, value in result["tracks"]["stable"]] == [None, 0.0]
    assert [value for _, value in result["tracks"]["candidate"]] == [None, 1.0]


def test_error_rate_through_the_api(api, chat):
    _, _, (first, _) = chat
    event(1, None, status=503, error_kind="shed")
    event(2, first)
    client = api("viewer")
    start, end = T0.isoformat(), (T0 + timedelta(minutes=1)).isoformat()
    response = client.get("/api/v1/deployments/chat/metrics/", {"series": "error_rate", "start": start,
                                                                "end": end, "step": "60", "events": "true"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["unit"] == "fraction" and body["points"] == [[start, 0.5]] and body["events"] == []
    assert "events" not in client.get("/api/v1/deployments/chat/metrics/", {"series": "error_rate"}).json()
    for query, field in (({"series": "error_rate", "version": "1"}, "version"),
                         ({"series": "error_rate", "events": "maybe"}, "events"),
                         ({"series": "errors"}, "series")):
        response = client.get("/api/v1/deployments/chat/metrics/", query)
        assert response.status_code == 400 and field in response.json(), (query, response.content)
    assert "error_rate" in client.get("/api/v1/deployments/chat/metrics/", {"series": "x"}).json()["series"][0]


# ---------------------------------------------------------------------------- partial steps


def test_the_step_in_progress_is_divided_by_the_seconds_it_covers(chat):
    deployment, _, (first, _) = chat
    ReplicaMetricsMinute.objects.create(replica=first, deployment=deployment, version=first.version, start=T0,
                                        scrapes=2, requests_by_reason={"stop": 60})
    # 60 requests in the first 30 s of the step: 2/s, not 1/s over a minute that has not passed.
    points = deployment_series(deployment, "requests_per_s", T0, T0 + timedelta(seconds=30), 60,
                               now=T0 + timedelta(seconds=30))
    assert points == [[T0.isoformat(), pytest.approx(2.0)]]
    points = deployment_series(deployment, "requests_per_s", T0, T0 + timedelta(minutes=1), 60,
                               now=T0 + timedelta(hours=1))
    assert points == [[T0.isoformat(), pytest.approx(1.0)]]


# ---------------------------------------------------------------------------- events


def test_events_list_deploys_rollouts_restarts_and_alerts(chat, make_user):
    deployment, (v1, v2), (first, _) = chat
    actor = make_user("operator")
    created = audit_record(actor=actor, action="deployment.create", obj=deployment,
                           after={"version": v1.pk, "replicas": 1})
    scaled = audit_record(actor=actor, action="deployment.update", obj=deployment,
                          before={"version": v1.pk, "replicas": 1, "engine_args": {}},
                          after={"version": v2.pk, "replicas": 2, "engine_args": {}})
    for audit, seconds in ((created, 5), (scaled, 20)):
        type(audit).objects.filter(pk=audit.pk).update(created_at=T0 + timedelta(seconds=seconds))
    rollout = Rollout.objects.create(
        deployment=deployment, stable_version=v1, candidate_version=v2, step_started_at=T0, status="aborted",
        finished_at=T0 + timedelta(seconds=90), timeline=[
            {"at": (T0 + timedelta(seconds=30)).isoformat(), "event": "created", "detail": "v1 → v2 (canary)"},
            {"at": (T0 + timedelta(seconds=40)).isoformat(), "event": "weight", "detail": "20% on the candidate"},
            {"at": (T0 + timedelta(seconds=60)).isoformat(), "event": "promoted", "detail": "by ops"},
            {"at": (T0 + timedelta(seconds=90)).isoformat(), "event": "aborted", "detail": "error rate 0.4"},
        ])
    Rollout.objects.filter(pk=rollout.pk).update(created_at=T0 + timedelta(seconds=30))
    Replica.objects.filter(pk=first.pk).update(restarts=3, started_at=T0 + timedelta(seconds=100),
                                               last_error="exited with code 137 (killed: out of memory)")
    Alert.objects.create(fingerprint="f1", labels={"deployment": "chat", "alertname": "SloBurn"},
                         annotations={"summary": "chat-availability burns its budget 14x"}, severity="page",
                         starts_at=T0 + timedelta(seconds=110), ends_at=T0 + timedelta(seconds=150),
                         status="resolved")
    Alert.objects.create(fingerprint="f2", labels={"deployment": "other"}, severity="page",
                         starts_at=T0 + timedelta(seconds=110))

    events = deployment_events(deployment, T0, T0 + timedelta(minutes=5))
    assert [(e["kind"], e["text"]) for e in events] == [
        ("deploy", "Deployed v1 × 1 by operator-user"),
        ("deploy", "Changed version v1 → v2, replicas 1 → 2 by operator-user"),
        ("rollout", f"Rollout {rollout.pk} started: v1 → v2 (canary)"),
        ("rollout", f"Rollout {rollout.pk} promoted: by ops"),
        ("rollout", f"Rollout {rollout.pk} aborted: error rate 0.4"),
        ("restart", f"Replica {first.pk} restarted (restart 3): exited with code 137 (killed: out of memory)"),
        ("alert", "Alert fired (page): chat-availability burns its budget 14x"),
        ("alert", "Alert resolved: chat-availability burns its budget 14x"),
    ]
    assert events[0]["at"] == (T0 + timedelta(seconds=5)).isoformat()
    # A range that holds none of them lists none.
    assert deployment_events(deployment, T0 - timedelta(hours=1), T0) == []
