"""The schedules API: create, read, replace and delete schedules with their layers; who is on
call and next; the timeline; overrides. Viewers read, operators write; bad input is a 400 that
names the field and writes nothing; a duplicate name is a 409."""

from __future__ import annotations

import pytest

from alerts.models import EscalationPolicy, EscalationStep, Schedule, ScheduleOverride
from inferops.models import AuditEvent
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db

URL = "/api/v1/schedules/"


@pytest.fixture
def people(make_user):
    return {name: make_user(None, username=name) for name in ("alice", "bob", "carol")}


def body(**changes) -> dict:
    return {"name": "primary", "time_zone": "Europe/Berlin", "description": "database team",
            "layers": [{"name": "weekly", "rotation": "weekly", "starts_at": "2025-03-03T09:00:00+01:00",
                        "ends_at": None, "users": ["alice", "bob"]},
                       {"name": "cover", "rotation": "daily", "starts_at": "2025-03-12T09:00:00+01:00",
                        "ends_at": "2025-03-14T09:00:00+01:00", "users": ["carol"]}], **changes}


def test_create_read_replace_and_delete(api, people):
    operator = api("operator")
    created = operator.post(URL, body(), format="json")
    assert created.status_code == 201, created.content
    schedule = created.json()
    assert schedule["name"] == "primary" and schedule["time_zone"] == "Europe/Berlin"
    assert [(layer["name"], layer["users"]) for layer in schedule["layers"]] == [
        ("weekly", ["alice", "bob"]), ("cover", ["carol"])]
    assert schedule["layers"][0]["starts_at"] == "2025-03-03T08:00:00Z" and schedule["overrides"] == []

    viewer = api("viewer")
    assert viewer.get(f"{URL}primary/").json() == schedule
    assert [s["name"] for s in viewer.get(URL).json()] == ["primary"]

    replaced = operator.put(f"{URL}primary/", body(name="db-primary", time_zone="UTC", layers=[
        {"rotation": "daily", "starts_at": "2025-03-03T09:00:00Z", "users": ["bob", "bob", "alice"]}]), format="json")
    assert replaced.status_code == 200, replaced.content
    assert replaced.json()["layers"] == [{"name": "", "rotation": "daily", "starts_at": "2025-03-03T09:00:00Z",
                                          "ends_at": None, "users": ["bob", "bob", "alice"]}]
    assert viewer.get(f"{URL}primary/").status_code == 404
    assert operator.delete(f"{URL}db-primary/").status_code == 204
    assert not Schedule.objects.exists()
    assert list(AuditEvent.objects.filter(object_type="alerts.schedule").order_by("id")
                .values_list("action", flat=True)) == ["schedule.create", "schedule.update", "schedule.delete"]


def test_on_call_now_and_next_and_the_timeline(api, people):
    operator = api("operator")
    operator.post(URL, body(), format="json")
    viewer = api("viewer")
    answer = viewer.get(f"{URL}primary/on-call/", {"at": "2025-03-11T12:00:00+01:00"})
    assert answer.status_code == 200
    # Week 2 is bob's; carol's cover layer starts on the 12th at 09:00 Berlin time.
    assert answer.json() == {"now": {"user": "bob", "until": "2025-03-12T08:00:00Z"},
                             "next": {"user": "carol", "from": "2025-03-12T08:00:00Z"}}
    shifts = viewer.get(f"{URL}primary/shifts/", {"start": "2025-03-10T08:00:00Z", "end": "2025-03-17T08:00:00Z"})
    assert shifts.json() == [
        {"user": "bob", "starts_at": "2025-03-10T08:00:00Z", "ends_at": "2025-03-12T08:00:00Z", "source": "layer 1"},
        {"user": "carol", "starts_at": "2025-03-12T08:00:00Z", "ends_at": "2025-03-14T08:00:00Z", "source": "layer 2"},
        {"user": "bob", "starts_at": "2025-03-14T08:00:00Z", "ends_at": "2025-03-17T08:00:00Z", "source": "layer 1"}]
    # Before anything starts: nobody, then alice at the first hand-off (within the 60 days looked ahead).
    early = viewer.get(f"{URL}primary/on-call/", {"at": "2025-02-01T00:00:00Z"}).json()
    assert early == {"now": {"user": None, "until": "2025-03-03T08:00:00Z"},
                     "next": {"user": "alice", "from": "2025-03-03T08:00:00Z"}}
    assert viewer.get(f"{URL}primary/on-call/").status_code == 200  # now, by default


def test_overrides_through_the_api(api, people):
    operator = api("operator")
    operator.post(URL, body(), format="json")
    override = {"user": "carol", "starts_at": "2025-03-04T00:00:00Z", "ends_at": "2025-03-04T06:00:00Z",
                "reason": "swap"}
    created = operator.post(f"{URL}primary/overrides/", override, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["user"] == "carol" and created.json()["created_by"] == "operator-api"
    on_call = api("viewer").get(f"{URL}primary/on-call/", {"at": "2025-03-04T01:00:00Z"}).json()
    assert on_call == {"now": {"user": "carol", "until": "2025-03-04T06:00:00Z"},
                       "next": {"user": "alice", "from": "2025-03-04T06:00:00Z"}}
    pk = created.json()["id"]
    assert api("viewer").delete(f"{URL}primary/overrides/{pk}/").status_code == 403
    assert operator.delete(f"{URL}primary/overrides/{pk}/").status_code == 204
    assert operator.delete(f"{URL}primary/overrides/{pk}/").status_code == 404
    assert operator.post(f"{URL}nope/overrides/", override, format="json").status_code == 404
    for changes, field in [({"user": "zed"}, "user"), ({"ends_at": "2025-03-03T00:00:00Z"}, "ends_at"),
                           ({"starts_at": "tuesday"}, "starts_at"), ({"when": "now"}, "when")]:
        answer = operator.post(f"{URL}primary/overrides/", {**override, **changes}, format="json")
        assert answer.status_code == 400 and field in answer.json(), answer.content
    assert not ScheduleOverride.objects.exists()
    assert list(AuditEvent.objects.filter(object_type="alerts.scheduleoverride").values_list("action", flat=True)
                .order_by("id")) == ["schedule.override.create", "schedule.override.delete"]


def test_roles(api, people):
    assert api(None).get(URL).status_code == 401
    assert api("viewer").post(URL, body(), format="json").status_code == 403
    assert api("operator").post(URL, body(), format="json").status_code == 201
    assert api("viewer").get(f"{URL}primary/shifts/").status_code == 200
    assert api("viewer").put(f"{URL}primary/", body(), format="json").status_code == 403
    assert api("viewer").delete(f"{URL}primary/").status_code == 403
    assert api("viewer").post(f"{URL}primary/overrides/", {}, format="json").status_code == 403


def layer_with(**changes) -> dict:
    return {**body()["layers"][0], **changes}


@pytest.mark.parametrize(("changes", "field"), [
    ({"time_zone": "Mars/Olympus"}, "time_zone"),
    ({"time_zone": "../../etc/passwd"}, "time_zone"),
    ({"name": "Has Spaces"}, "name"),
    ({"layers": [layer_with(users=["alice", "zed"])]}, "layers"),
    ({"layers": [layer_with(users=[])]}, "layers"),
    ({"layers": [layer_with(rotation="hourly")]}, "layers"),
    ({"layers": [layer_with(ends_at="2025-03-01T00:00:00Z")]}, "layers"),
    ({"layers": [layer_with(starts_at="next monday")]}, "layers"),
    ({"layers": [layer_with(starts_at=None)]}, "layers"),
    ({"layers": [layer_with(colour="red")]}, "layers"),
    ({"layers": "alice,bob"}, "layers"),
    ({"owner": "alice"}, "owner"),
])
def test_bad_schedules_are_400_naming_the_field(api, people, changes, field):
    answer = api("operator").post(URL, body(**changes), format="json")
    assert answer.status_code == 400, answer.content
    assert field in answer.json(), answer.json()
    assert not Schedule.objects.exists() and not AuditEvent.objects.exists()


def test_conflicts_and_bad_queries(api, people):
    operator = api("operator")
    assert operator.post(URL, body(), format="json").status_code == 201
    duplicate = operator.post(URL, body(), format="json")
    assert duplicate.status_code == 409 and "primary" in duplicate.json()["detail"]
    operator.post(URL, body(name="secondary"), format="json")
    assert operator.put(f"{URL}secondary/", body(name="primary"), format="json").status_code == 409
    assert operator.put(f"{URL}missing/", body(), format="json").status_code == 404

    policy = EscalationPolicy.objects.create(name="db-escalation")
    EscalationStep.objects.create(policy=policy, position=0, after_minutes=5, schedule=Schedule.objects.get(
        name="primary"))
    refused = operator.delete(f"{URL}primary/")
    assert refused.status_code == 409 and "db-escalation" in refused.json()["detail"]
    assert Schedule.objects.filter(name="primary").exists()

    viewer = api("viewer")
    assert viewer.get(f"{URL}primary/on-call/", {"at": "yesterday"}).status_code == 400
    assert "at" in viewer.get(f"{URL}primary/on-call/", {"at": "yesterday"}).json()
    too_long = viewer.get(f"{URL}primary/shifts/", {"start": "2025-01-01T00:00:00Z", "end": "2025-06-01T00:00:00Z"})
    assert too_long.status_code == 400 and "end" in too_long.json()
    backwards = viewer.get(f"{URL}primary/shifts/", {"start": "2025-02-01T00:00:00Z", "end": "2025-01-01T00:00:00Z"})
    assert backwards.status_code == 400 and "end" in backwards.json()
    assert "start" in viewer.get(f"{URL}primary/shifts/", {"start": "soon"}).json()
    assert viewer.get(f"{URL}nope/on-call/").status_code == 404


def test_the_schema_documents_the_schedule_endpoints(api):
    schema = api("viewer").get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    text = schema.content.decode()
    for path in ("/api/v1/schedules/", "/api/v1/schedules/{name}/on-call/", "/api/v1/schedules/{name}/shifts/",
                 "/api/v1/schedules/{name}/overrides/{id}/"):
        assert path in text, path


def test_on_call_at_an_offset_postgres_refuses_is_answered_not_a_500(api, people):
    # Found by the REST fuzzer (issue 40): Python takes a -16:02 offset, Postgres does not; `at` is now read in UTC.
    api("operator").post(URL, body(), format="json")
    viewer = api("viewer")
    far_offset = viewer.get(f"{URL}primary/on-call/", {"at": "1006-06-16T11:04:45.758041-16:02"})
    assert far_offset.status_code == 200
    assert_answer_matches_schema(far_offset, "GET", "/api/v1/schedules/{name}/on-call/")
    before_year_one = viewer.get(f"{URL}primary/on-call/", {"at": "0001-01-01T00:00:00+05:00"})
    assert before_year_one.status_code == 400 and "at" in before_year_one.json()
