"""SLO and alert REST API: the issue's contract, roles, and every bad input refused by field."""

from __future__ import annotations

from datetime import timedelta

import pytest

from alerts.models import Alert, Receiver
from inferops.models import AuditEvent
from slo.budget import MINUTE
from slo.evaluation import evaluate_slos
from slo.models import Slo, SloMinute
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema
from tests.slo.conftest import NOW, event, insert_events, make_deployment

pytestmark = pytest.mark.django_db

BODY = {"name": "chat-ttft", "deployment": "chat", "sli": {"kind": "latency", "ttft_ms": 500},
        "objective": 0.995, "window": "1d", "budgeting": "occurrences"}


def post(client, **changes):
    return client.post("/api/v1/slos/", {**BODY, **changes}, format="json")


def test_create_get_list_and_status_contract(api, deployment):
    client = api("operator")
    response = post(client, runbook_url="https://runbooks.example/ttft", owner="serving")
    assert response.status_code == 201, response.content
    body = response.json()
    assert {k: body[k] for k in ("name", "deployment", "sli", "objective", "window", "budgeting", "scope")} == {
        "name": "chat-ttft", "deployment": "chat", "objective": 0.995, "window": "1d", "budgeting": "occurrences",
        "sli": {"kind": "latency", "ttft_ms": 500.0, "tpot_ms": None, "e2e_ms": None}, "scope": "deployment",
    }
    assert body["backfilled_from"] is None and body["status"]["evaluated_at"] is None
    assert AuditEvent.objects.filter(action="slo.create").count() == 1

    insert_events([event(NOW - MINUTE, ttft_ms=2000.0 if i % 2 else 100.0) for i in range(40)]
                  + [event(NOW, ttft_ms=2000.0 if i % 2 else 100.0) for i in range(40)])
    evaluate_slos(now=NOW)
    viewer = api("viewer")
    status = viewer.get(f"/api/v1/slos/{body['id']}/status/").json()
    assert status["sli"] == 0.5 and status["status"] == "exhausted"
    assert set(status["burn_rates"]) == {"5m", "30m", "1h", "2h", "6h", "1d", "3d"}
    assert status["burn_rates"]["5m"] == pytest.approx(0.5 / 0.005)
    assert status["budget_remaining"] == pytest.approx(1 - 40 / (0.005 * 80))
    assert sorted((a["severity"], a["status"]) for a in status["alerts"]) == [("page", "firing"), ("ticket", "firing")]
    assert status["backfilled_from"] == "2026-03-10T11:59:00Z"  # the first minute with events (NOW - 1 min)
    assert status["alert_thresholds"][0] == {"severity": "page", "factor": 14.4, "long_window_minutes": 2,
                                             "short_window_minutes": 1, "long_window": "2m", "short_window": "1m"}
    assert status["min_events"] == 20 and status["total"] == 80

    alerts = viewer.get("/api/v1/alerts/?status=firing").json()["results"]
    assert {a["severity"] for a in alerts} == {"page", "ticket"}
    assert set(alerts[0]) >= {"id", "fingerprint", "slo", "severity", "status", "starts_at", "ends_at", "labels",
                              "annotations"}
    assert alerts[0]["slo"] == "chat-ttft"
    assert viewer.get("/api/v1/alerts/?status=resolved").json()["results"] == []
    assert viewer.get("/api/v1/alerts/?status=open").status_code == 400

    # The list is sorted by remaining budget: the burnt SLO first.
    post(client, name="chat-availability", sli={"kind": "availability"})
    evaluate_slos(now=NOW)
    names = [s["name"] for s in viewer.get("/api/v1/slos/").json()["results"]]
    assert names == ["chat-ttft", "chat-availability"]


def test_history_for_charts(api, deployment):
    client = api("operator")
    slo_id = post(client).json()["id"]
    # One event three days back: the SLO's data begin there, so the ranges below hold data.
    insert_events([event(NOW - timedelta(days=3)), event(NOW - 3 * MINUTE, ttft_ms=2000.0),
                   event(NOW - 3 * MINUTE), event(NOW)])
    evaluate_slos(now=NOW)
    start = (NOW - 5 * MINUTE).isoformat()
    history = client.get(f"/api/v1/slos/{slo_id}/history/", {"start": start, "end": NOW.isoformat()}).json()
    assert history["step"] == "minute" and len(history["points"]) == 6
    # The last point is the evaluation's own moment, the one the status shows.
    assert history["points"][-1]["time"] == history["evaluated_at"] == NOW.isoformat().replace("+00:00", "Z")
    sli = [p["sli"] for p in history["points"]]
    assert sli == [None, None, 0.5, 0.5, 0.5, 2 / 3]
    assert history["points"][2]["burn_rates"]["5m"] == pytest.approx(0.5 / 0.005)
    hourly = client.get(f"/api/v1/slos/{slo_id}/history/",
                        {"start": (NOW - timedelta(days=3)).isoformat(), "end": NOW.isoformat()}).json()
    assert hourly["step"] == "hour" and len(hourly["points"]) == 73
    bad = client.get(f"/api/v1/slos/{slo_id}/history/", {"start": "yesterday"})
    assert bad.status_code == 400 and "start" in bad.json()
    too_many = client.get(f"/api/v1/slos/{slo_id}/history/", {"start": (NOW - timedelta(days=3)).isoformat(),
                                                              "end": NOW.isoformat(), "step": "minute"})
    assert too_many.status_code == 400 and "end" in too_many.json()


def test_patch_and_delete(api, deployment):
    client = api("operator")
    slo_id = post(client).json()["id"]
    insert_events([event(NOW)])
    evaluate_slos(now=NOW)
    assert SloMinute.objects.filter(slo_id=slo_id).count() == 1
    # Objective and window changes keep the minutes; an SLI change drops them for a back-fill.
    response = client.patch(f"/api/v1/slos/{slo_id}/", {"objective": 0.99, "window": "7d"}, format="json")
    assert response.status_code == 200 and response.json()["window"] == "7d"
    assert SloMinute.objects.filter(slo_id=slo_id).count() == 1
    response = client.patch(f"/api/v1/slos/{slo_id}/", {"sli": {"kind": "latency", "ttft_ms": 250}}, format="json")
    assert response.json()["sli"]["ttft_ms"] == 250.0
    assert SloMinute.objects.filter(slo_id=slo_id).count() == 0
    assert Slo.objects.get(pk=slo_id).watermark is None

    Alert.objects.create(fingerprint="f" * 16, severity="page", starts_at=NOW, slo_id=slo_id, labels={})
    assert client.delete(f"/api/v1/slos/{slo_id}/").status_code == 204
    assert not Slo.objects.filter(pk=slo_id).exists()
    alert = Alert.objects.get()
    assert alert.slo is None and alert.status == "resolved"  # history kept, the episode ended
    assert client.get(f"/api/v1/slos/{slo_id}/").status_code == 404


@pytest.mark.parametrize(("changes", "field"), [
    ({"objective": 1.0}, "objective"),
    ({"objective": 0}, "objective"),
    ({"window": "90d"}, "window"),
    ({"budgeting": "timeslices"}, "timeslice_target"),
    ({"timeslice_target": 0.9}, "timeslice_target"),
    ({"sli": {"kind": "latency"}}, "sli.ttft_ms"),
    ({"sli": {"kind": "availability", "ttft_ms": 100}}, "sli.ttft_ms"),
    ({"sli": {"kind": "ratio", "good": "prefix_cache_hits", "total": "bogus"}}, "sli.total"),
    ({"sli": {"kind": "speed"}}, "sli"),
    ({"sli": {"kind": "latency", "ttft_ms": -1}}, "sli"),
    ({"deployment": "nope"}, "deployment"),
    ({"deployment": None}, "deployment"),
    ({"time_zone": "Mars/Olympus"}, "time_zone"),
    ({"name": "Not A Slug"}, "name"),
    ({"scope": "tenant"}, "tenant"),
    ({"min_requests": -1}, "min_requests"),
])
def test_bad_inputs_name_the_field(api, deployment, changes, field):
    response = post(api("operator"), **changes)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not Slo.objects.exists()


def test_duplicate_name_conflicts(api, deployment):
    client = api("operator")
    assert post(client).status_code == 201
    response = post(client)
    assert response.status_code == 409


def test_other_scopes_and_ratio(api, deployment):
    client = api("operator")
    response = post(client, name="acme", tenant="acme")
    assert response.status_code == 201 and response.json()["scope"] == "tenant"
    response = post(client, name="all-tiny", deployment=None, model="tiny")
    assert response.status_code == 201 and response.json()["scope"] == "model"
    response = post(client, name="cache-hits", sli={"kind": "ratio", "good": "prefix_cache_hits",
                                                    "total": "prefix_cache_queries"}, objective=0.5)
    assert response.status_code == 201
    assert response.json()["sli"] == {"kind": "ratio", "ttft_ms": None, "tpot_ms": None, "e2e_ms": None,
                                      "good": "prefix_cache_hits", "total": "prefix_cache_queries"}
    response = post(client, name="ratio-tenant", tenant="acme",
                    sli={"kind": "ratio", "good": "prefix_cache_hits", "total": "prefix_cache_queries"})
    assert response.status_code == 400 and "scope" in response.json()


def test_roles(api, deployment):
    assert api(None).get("/api/v1/slos/").status_code == 401
    assert post(api("viewer")).status_code == 403
    assert api("viewer").get("/api/v1/alerts/").status_code == 200
    receiver = {"name": "oncall", "url": "https://hooks.example/alertmanager"}
    assert api("operator").get("/api/v1/receivers/").status_code == 403
    assert api("operator").post("/api/v1/receivers/", receiver, format="json").status_code == 403
    admin = api("admin")
    created = admin.post("/api/v1/receivers/", receiver, format="json")
    assert created.status_code == 201 and created.json()["send_resolved"] is True
    assert admin.post("/api/v1/receivers/", receiver, format="json").status_code == 409
    assert admin.post("/api/v1/receivers/", {"name": "x", "url": "not a url"}, format="json").status_code == 400
    rid = created.json()["id"]
    assert admin.patch(f"/api/v1/receivers/{rid}/", {"active": False}, format="json").json()["active"] is False
    assert admin.get(f"/api/v1/receivers/{rid}/deliveries/").json()["results"] == []
    assert admin.delete(f"/api/v1/receivers/{rid}/").status_code == 204
    assert not Receiver.objects.exists()


def test_schema_generates(api, deployment):
    make_deployment("other")
    response = api("viewer").get("/api/schema/")
    assert response.status_code == 200


def test_history_starts_with_the_data_and_ends_at_the_evaluation(api, deployment):
    """A day's chart of an SLO whose data began 3 minutes ago holds those minutes only (no 100 %
    budget before the SLO existed), and nothing after the last evaluation (no minute not yet
    folded in, which would read as no traffic)."""
    client = api("operator")
    slo_id = post(client).json()["id"]
    insert_events([event(NOW - 3 * MINUTE, ttft_ms=2000.0), event(NOW - 3 * MINUTE), event(NOW)])
    assert client.get(f"/api/v1/slos/{slo_id}/history/").json()["points"] == []  # not evaluated yet
    evaluate_slos(now=NOW)
    start, later = (NOW - timedelta(hours=23)).isoformat(), (NOW + 10 * MINUTE).isoformat()
    history = client.get(f"/api/v1/slos/{slo_id}/history/", {"start": start, "end": later}).json()
    times = [p["time"] for p in history["points"]]
    first = (NOW - 3 * MINUTE).replace(second=0).isoformat().replace("+00:00", "Z")
    assert history["data_start"] == first and times[0] == first
    assert times[-1] == history["evaluated_at"] and len(times) == 4
    budgets = [p["budget_remaining"] for p in history["points"]]
    status = client.get(f"/api/v1/slos/{slo_id}/status/").json()
    assert budgets[-1] == status["budget_remaining"] < 0  # overspent reads negative, as in the status
    assert all(p["insufficient_traffic"] for p in history["points"])
    hourly = client.get(f"/api/v1/slos/{slo_id}/history/", {"start": start, "end": later, "step": "hour"}).json()
    assert [p["time"] for p in hourly["points"]] == [first, history["evaluated_at"]]


def test_an_slo_without_a_runbook_url_matches_the_schema(api, deployment):
    # Found by the REST fuzzer (issue 40): the schema called runbook_url a URI, and "" is none.
    created = post(api("operator"))
    assert_answer_matches_schema(created, "POST", "/api/v1/slos/")
    response = api("viewer").get(f"/api/v1/slos/{created.json()['id']}/")
    assert response.json()["runbook_url"] == ""
    assert_answer_matches_schema(response, "GET", "/api/v1/slos/{id}/")
