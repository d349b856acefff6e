"""Rollouts REST API: create, the shape CI polls, actions and their conflicts, every bad input refused.

No replica runs here: the rollout's state is moved by the service calls the reconcile pass makes
(`advance`), and the reconcile task queued on commit never runs inside a test transaction.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts import machine as rollout_machine
from deployments.rollouts import services as rollouts
from deployments.rollouts import watch as rollout_watch
from inferops.models import AuditEvent
from registry.models import Alias, RegisteredModel
from slo.models import SloStatus
from slo.services import slo_create
from tests.deployments.conftest import make_version

pytestmark = pytest.mark.django_db

OMIT = object()


@pytest.fixture
def deployment(db) -> Deployment:
    """`chat` on v1 of `tiny` (2 replicas); v2 is aliased `canary`, v3 exists. No checkpoint needed."""
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    v1, v2, _ = (make_version(model, n) for n in (1, 2, 3))
    Alias.objects.create(model=model, name="canary", version=v2)
    Alias.objects.create(model=model, name="champion", version=v1)
    return Deployment.objects.create(name="chat", model=model, version=v1, replicas=2, min_replicas=2,
                                     max_replicas=2, engine_args={"max_num_seqs": 8})


URL = "/api/v1/deployments/chat/rollouts/"


def start(client, name: str = "chat", **body):
    payload = {"version": 2, **body}
    return client.post(f"/api/v1/deployments/{name}/rollouts/",
                       {k: v for k, v in payload.items() if v is not OMIT}, format="json")


def written() -> tuple[int, int]:
    return Rollout.objects.count(), AuditEvent.objects.filter(action__startswith="rollout").count()


def exhaust_budget(deployment: Deployment, name: str = "chat-availability"):
    slo = slo_create(actor=None, name=name, deployment=deployment, sli_kind="availability", objective=0.99,
                     window="1d")
    SloStatus.objects.filter(slo=slo).update(budget_remaining=-0.2)
    return slo


def test_create_and_the_shape_ci_polls(api, deployment):
    client = api("operator")
    steps = [{"set_weight": 20}, {"pause": "60s"}, {"analysis": {"duration": "2m", "thresholds": {
        "ttft_p95_ratio": 1.2}}}]
    response = start(client, steps=steps)
    assert response.status_code == 201, response.content
    body = response.json()
    assert set(body) == {
        "id", "deployment", "strategy", "status", "rollback", "stable", "candidate", "steps", "current_step",
        "weight", "message", "timeline", "scale_down_delay_s", "scale_down_at", "promote_alias",
        "override_reason", "created_by", "created_at", "updated_at", "finished_at", "measurements", "frozen_since",
        "watch_s", "auto_rollback", "holdback_percent", "watch_until", "watching", "rolled_back_by", "quality"}
    assert {k: body[k] for k in ("deployment", "strategy", "status", "rollback", "weight", "promote_alias",
                                 "created_by", "finished_at", "measurements", "watch_s", "auto_rollback",
                                 "holdback_percent", "watch_until", "watching", "rolled_back_by")} == {
        "deployment": "chat", "strategy": "canary", "status": "progressing", "rollback": False, "weight": 0,
        "promote_alias": "champion", "created_by": "operator-api", "finished_at": None, "measurements": [],
        "watch_s": 600.0, "auto_rollback": True, "holdback_percent": 5, "watch_until": None, "watching": False,
        "rolled_back_by": None}
    assert body["stable"] == {"version": 1, "engine_args": {"max_num_seqs": 8}}
    assert body["candidate"] == {"version": 2, "engine_args": {"max_num_seqs": 8}, "alias": ""}
    assert body["steps"] == [{"set_weight": 20}, {"pause": 60.0}, {"analysis": {
        "duration": 120.0, "min_requests": 20, "max_burn_rate": 2.0, "thresholds": {"ttft_p95_ratio": 1.2}}}]
    assert body["current_step"] == {"index": 0, "step": {"set_weight": 20}}
    assert body["timeline"][0]["event"] == "created" and "v1 → v2" in body["timeline"][0]["detail"]
    assert AuditEvent.objects.filter(action="rollout.create", object_id=str(body["id"])).count() == 1

    assert client.get(f"{URL}{body['id']}/").json() == body
    listed = api("viewer").get(URL).json()
    assert listed["count"] == 1 and "measurements" not in listed["results"][0]
    assert {k: v for k, v in body.items() if k != "measurements"} == listed["results"][0]


def test_candidate_by_alias_engine_args_and_defaults(api, deployment):
    client = api("operator")
    body = start(client, version=OMIT, alias="canary", promote_alias="").json()
    assert body["candidate"] == {"version": 2, "engine_args": {"max_num_seqs": 8}, "alias": "canary"}
    assert body["promote_alias"] == "" and body["steps"][0] == {"set_weight": 10} and len(body["steps"]) == 4
    client.post(f"{URL}{body['id']}/abort/", format="json")

    body = start(client, version=OMIT, engine_args={"max_num_seqs": 16, "fault_ttft_ms": 200}).json()
    assert body["stable"]["version"] == body["candidate"]["version"] == 1
    assert body["candidate"]["engine_args"] == {"max_num_seqs": 16, "fault_ttft_ms": 200}
    client.post(f"{URL}{body['id']}/abort/", format="json")

    response = start(client, version=3, strategy="blue-green", preview={}, analysis="1m", scale_down_delay="10m")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["strategy"], body["status"], body["scale_down_delay_s"]) == ("blue-green", "paused", 600.0)
    assert body["steps"] == [{"pause": None}, {"set_weight": 100}, {"analysis": {
        "duration": 60.0, "min_requests": 20, "max_burn_rate": 2.0, "thresholds": {}}}]
    assert body["message"] == "Paused until an operator promotes."


@pytest.mark.parametrize("body,field,fragment", [
    ({"version": "two"}, "version", "valid integer"),
    ({"version": 0}, "version", "greater than or equal to 1"),
    ({"version": 9}, "version", "no version 9"),
    ({"version": 2**40}, "version", "no version 1099511627776"),
    ({"steps": [{"analysis": {"duration": "2m", "min_requests": 2**70}}]}, "steps", "min_requests"),
    ({"version": None, "alias": "missing"}, "alias", "no alias 'missing'"),
    ({"alias": "canary"}, "version", "not both"),
    ({"version": 1}, "version", "nothing to roll out"),
    ({"version": None}, "version", "Give the candidate"),
    ({"engine_args": ["max_num_seqs"]}, "engine_args", "dictionary"),
    ({"engine_args": {"warp_drive": True}}, "engine_args", "warp_drive: not an option"),
    ({"engine_args": {"max_num_seqs": "many"}}, "engine_args", "max_num_seqs"),
    ({"strategy": "linear"}, "strategy", "not a valid choice"),
    ({"rollback": "perhaps"}, "rollback", "valid boolean"),
    ({"override_reason": ["why"]}, "override_reason", "Not a valid string"),
    ({"promote_alias": "Not An Alias"}, "promote_alias", "lowercase"),
    ({"steps": "fast"}, "steps", "Expected a list of steps"),
    ({"steps": [{"jump": 5}]}, "steps", "unknown step 'jump'"),
    ({"steps": [{"set_weight": 150}]}, "steps", "steps[0].set_weight: expected an integer percent 0-100"),
    ({"steps": [{"set_weight": 20, "pause": "1m"}]}, "steps", "one key"),
    ({"steps": [{"set_weight": 20}, {"pause": "soon"}]}, "steps", "steps[1].pause: expected a duration"),
    ({"steps": [{"analysis": "-5m"}]}, "steps", "expected a duration"),
    ({"steps": [{"analysis": {"duration": "2m", "max_errors": 1}}]}, "steps", "unknown key(s) max_errors"),
    ({"steps": [{"analysis": {"duration": "2m", "thresholds": {"ttft_p95_ratio": "x"}}}]}, "steps", "number > 0"),
    ({"steps": [{"set_weight": 5}] * 51}, "steps", "At most 50 steps"),
    ({"scale_down_delay": "10m"}, "scale_down_delay", "applies to blue-green"),
    ({"strategy": "blue-green", "scale_down_delay": "ten minutes"}, "scale_down_delay", "expected a duration"),
    ({"strategy": "blue-green", "scale_down_delay": 10**7}, "scale_down_delay", "between 0 and 7 days"),
    ({"strategy": "blue-green", "analysis": {"min_requests": 5}}, "analysis", "duration: required"),
    ({"strategy": "blue-green", "preview": True}, "preview", "expected a duration"),
    ({"strategy": "blue-green", "steps": [{"set_weight": 50}]}, "steps", "no steps"),
    ({"stpes": []}, "stpes", "Unknown field"),
    ({"watch": "soon"}, "watch", "expected a duration"),
    ({"watch": -5}, "watch", "between 0 and 7 days"),
    ({"auto_rollback": "maybe"}, "auto_rollback", "valid boolean"),
])
def test_bad_input_is_400_and_writes_nothing(api, deployment, body, field, fragment):
    response = start(api("operator"), **body)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert fragment in str(response.json()[field]), response.json()
    assert written() == (0, 0)


def test_service_refuses_an_alias_name_that_could_never_be_set(deployment):
    with pytest.raises(ValidationError) as refused:  # the console calls the service without the serializer
        rollouts.rollout_create(deployment=deployment, actor=None, version=2, promote_alias="Champion!")
    assert "promote_alias" in refused.value.message_dict and written() == (0, 0)


def test_malformed_bodies_are_400(api, deployment):
    client = api("operator")
    response = client.generic("POST", URL, '{"version": 2,', content_type="application/json")
    assert response.status_code == 400 and "JSON parse error" in response.json()["detail"]
    response = client.post(URL, [{"version": 2}], format="json")
    assert response.status_code == 400 and "non_field_errors" in response.json()
    assert client.post(URL, "version=2", content_type="application/x-www-form-urlencoded").status_code == 415
    assert written() == (0, 0)


def test_unknown_deployment_or_rollout_is_404_and_roles_are_checked(api, deployment):
    operator = api("operator")
    assert start(operator, name="nope").status_code == 404
    assert operator.get("/api/v1/deployments/nope/rollouts/").status_code == 404
    assert operator.post("/api/v1/deployments/nope/rollouts/undo/", format="json").status_code == 404
    rollout_id = start(operator).json()["id"]
    Deployment.objects.create(name="other", model=deployment.model, version=deployment.version)
    assert operator.get(f"/api/v1/deployments/other/rollouts/{rollout_id}/").status_code == 404
    assert operator.post(f"/api/v1/deployments/other/rollouts/{rollout_id}/abort/", format="json").status_code == 404
    assert operator.get(f"{URL}{rollout_id + 1}/").status_code == 404

    assert api(None).get(URL).status_code == 401
    viewer = api("viewer")
    assert viewer.get(f"{URL}{rollout_id}/").status_code == 200
    before = written()
    assert start(viewer, version=3).status_code == 403
    for action in ("promote", "abort", "retry"):
        assert viewer.post(f"{URL}{rollout_id}/{action}/", format="json").status_code == 403
    assert viewer.post(f"{URL}undo/", format="json").status_code == 403
    assert written() == before and Rollout.objects.get().status == "progressing"


def test_one_active_rollout_per_deployment(api, deployment):
    client = api("operator")
    first = start(client).json()
    before = written()
    response = start(client, version=3)
    assert response.status_code == 409
    assert f"Rollout {first['id']} of 'chat' is progressing" in response.json()["detail"]
    assert written() == before
    Deployment.objects.filter(pk=deployment.pk).update(paused=True)
    client.post(f"{URL}{first['id']}/abort/", format="json")
    response = start(client, version=3)
    assert response.status_code == 409 and "paused" in response.json()["detail"]


def test_exhausted_budget_refuses_unless_rollback_or_audited_override(api, deployment):
    exhaust_budget(deployment)
    client = api("operator")
    response = start(client)
    assert response.status_code == 409, response.content
    detail = response.json()["detail"]
    assert "Error budget exhausted" in detail and "'chat-availability'" in detail and "override_reason" in detail
    assert written() == (0, 0)

    rollback = start(client, rollback=True)
    assert rollback.status_code == 201 and rollback.json()["rollback"] is True
    assert not AuditEvent.objects.filter(action="rollout.budget_override").exists()
    client.post(f"{URL}{rollback.json()['id']}/abort/", format="json")

    override = start(client, override_reason="hotfix for incident 42")
    assert override.status_code == 201, override.content
    assert override.json()["override_reason"] == "hotfix for incident 42"
    assert "budget policy overridden: hotfix for incident 42" in override.json()["timeline"][0]["detail"]
    audit = AuditEvent.objects.get(action="rollout.budget_override")
    assert audit.object_id == str(override.json()["id"]) and audit.actor_name == "operator-api"
    assert audit.after["reason"] == "hotfix for incident 42"
    assert audit.after["exhausted"] == [["chat-availability", -0.2]]

    # Retrying an aborted rollout is gated the same way.
    rollout_id = override.json()["id"]
    client.post(f"{URL}{rollout_id}/abort/", format="json")
    response = client.post(f"{URL}{rollout_id}/retry/", format="json")
    assert response.status_code == 409 and "chat-availability" in response.json()["detail"]
    response = client.post(f"{URL}{rollout_id}/retry/", {"override_reason": "still the hotfix"}, format="json")
    assert response.status_code == 200 and response.json()["override_reason"] == "still the hotfix"
    assert [a.after["reason"] for a in AuditEvent.objects.filter(action="rollout.budget_override").order_by("id")] == [
        "hotfix for incident 42", "still the hotfix"]


def test_promote_abort_retry_transitions_and_conflicts(api, deployment):
    client = api("operator")
    body = start(client, steps=[{"pause": {}}, {"set_weight": 50}, {"analysis": "1m"}]).json()
    url = f"{URL}{body['id']}/"
    assert (body["status"], body["current_step"]["step"]) == ("paused", {"pause": None})

    response = client.post(f"{url}promote/", format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["status"], response.json()["current_step"]) == (
        "progressing", {"index": 1, "step": {"set_weight": 50}})
    assert response.json()["timeline"][-1]["event"] == "promoted"
    for bad in ({"full": "all the way"}, {"ful": True}, {"reason": "x" * 2001}, {"reason": ["why"]}):
        response = client.post(f"{url}promote/", bad, format="json")
        assert response.status_code == 400 and set(response.json()) == set(bad)
    response = client.post(f"{url}promote/", {"full": True, "reason": "v2 matches v1 on the eval set"}, format="json")
    assert response.json()["current_step"] == {"index": 3, "step": None}
    assert response.json()["timeline"][-1]["detail"] == "by operator-api (full): v2 matches v1 on the eval set"
    assert AuditEvent.objects.filter(action="rollout.promote").latest("id").after["reason"] == (
        "v2 matches v1 on the eval set")

    assert client.post(f"{url}retry/", format="json").status_code == 409  # only an aborted one
    assert client.post(f"{url}abort/", {"reason": 7, "why": "x"}, format="json").status_code == 400
    response = client.post(f"{url}abort/", {"reason": "latency looks off"}, format="json")
    assert response.status_code == 200
    aborted = response.json()
    assert (aborted["status"], aborted["weight"]) == ("aborted", 0) and aborted["finished_at"]
    assert aborted["message"] == "aborted by operator-api: latency looks off"
    assert [e["event"] for e in aborted["timeline"][-2:]] == ["aborted", "traffic on stable"]
    before = written()
    for action in ("promote", "abort"):
        response = client.post(f"{url}{action}/", format="json")
        assert response.status_code == 409 and "is aborted" in response.json()["detail"]
    assert written() == before

    response = client.post(f"{url}retry/", format="json")
    assert response.status_code == 200
    assert (response.json()["status"], response.json()["current_step"]["index"]) == ("paused", 0)
    assert response.json()["finished_at"] is None
    assert [e.action for e in AuditEvent.objects.filter(action__startswith="rollout.").order_by("id")] == [
        "rollout.create", "rollout.promote", "rollout.promote", "rollout.abort", "rollout.retry"]

    other = Rollout.objects.get()
    Rollout.objects.filter(pk=other.pk).update(status="aborted")  # retry while another rollout runs
    start(client, version=3)
    response = client.post(f"{url}retry/", format="json")
    assert response.status_code == 409 and "promote or abort it first" in response.json()["detail"]


def test_undo_aborts_the_active_rollout_or_rolls_back_the_last_success(api, deployment):
    client = api("operator")
    response = client.post(f"{URL}undo/", format="json")
    assert response.status_code == 409 and "Nothing to undo" in response.json()["detail"]

    active = start(client).json()
    response = client.post(f"{URL}undo/", format="json")
    assert response.status_code == 200 and response.json()["id"] == active["id"]
    assert response.json()["status"] == "aborted" and response.json()["message"].endswith(": undo")

    # A rollout that goes all the way, as the reconcile pass takes it once the candidate is ready.
    body = start(client, steps=[{"set_weight": 50}]).json()
    client.post(f"{URL}{body['id']}/promote/", {"full": True}, format="json")
    rollout_machine.advance(Deployment.objects.get(pk=deployment.pk), rollout_machine.CandidateState(ready=2),
                            timezone.now())
    done = client.get(f"{URL}{body['id']}/").json()
    assert (done["status"], done["weight"]) == ("succeeded", 100)
    assert client.get("/api/v1/deployments/chat/").json()["version"] == 2
    assert Alias.objects.get(name="champion").version.number == 2

    exhaust_budget(deployment)  # an undo is a rollback: the budget does not stop it
    response = client.post(f"{URL}undo/", format="json")
    assert response.status_code == 201, response.content
    undo = response.json()
    assert (undo["strategy"], undo["rollback"], undo["stable"]["version"], undo["candidate"]["version"]) == (
        "blue-green", True, 2, 1)
    assert client.post(f"{URL}undo/", {"force": True}, format="json").status_code == 400
    assert client.get(f"{URL}?status=succeeded").json()["count"] == 1
    assert [r["id"] for r in client.get(URL).json()["results"]] == [undo["id"], body["id"], active["id"]]


def test_measurements_latest_first_and_capped(api, deployment):
    client = api("operator")
    body = start(client, steps=[{"set_weight": 10}, {"analysis": "5m"}]).json()
    rollout = Rollout.objects.get(pk=body["id"])
    now = timezone.now()
    check = {"name": "availability (implied) burn rate", "candidate": 0.5, "stable": 0.4, "limit": 2.0, "ok": True}
    RolloutMeasurement.objects.bulk_create(RolloutMeasurement(
        rollout=rollout, step_index=1, taken_at=now + timedelta(seconds=10 * i), window_start=now,
        window_end=now + timedelta(seconds=10 * i), verdict="running", checks=[check],
        candidate={"requests": i}, stable={"requests": 2 * i}, reason=f"look {i}") for i in range(60))
    measurements = client.get(f"{URL}{body['id']}/").json()["measurements"]
    assert len(measurements) == 50 and [m["reason"] for m in measurements[:2]] == ["look 59", "look 58"]
    assert set(measurements[0]) == {"id", "step_index", "taken_at", "window_start", "window_end", "verdict",
                                    "checks", "candidate", "stable", "reason"}
    assert (measurements[0]["verdict"], measurements[0]["checks"], measurements[0]["candidate"]) == (
        "running", [check], {"requests": 59})
    Rollout.objects.filter(pk=rollout.pk).update(created_by=None)  # started by the system (or a deleted user)
    assert client.get(f"{URL}{body['id']}/").json()["created_by"] is None


def finish(deployment: Deployment, rollout_id: int, client, now=None) -> dict:
    """Promote all the way and let the reconcile pass finalize it, as it does once the candidate is ready."""
    client.post(f"{URL}{rollout_id}/promote/", {"full": True}, format="json")
    rollout_machine.advance(Deployment.objects.get(pk=deployment.pk), rollout_machine.CandidateState(ready=2),
                            now or timezone.now())
    return client.get(f"{URL}{rollout_id}/").json()


def test_the_watch_is_set_on_create_shown_and_turned_off_or_on(api, deployment):
    client = api("operator")
    body = start(client, watch="2m", auto_rollback=False).json()
    assert (body["watch_s"], body["auto_rollback"], body["watching"]) == (120.0, False, False)
    url = f"{URL}{body['id']}/"
    assert api("viewer").patch(url, {"auto_rollback": True}, format="json").status_code == 403
    for bad, fields in (({"auto_rollback": "maybe"}, {"auto_rollback"}), ({}, {"auto_rollback"}),
                        ({"auto_rollbak": True}, {"auto_rollbak", "auto_rollback"})):
        response = client.patch(url, bad, format="json")
        assert response.status_code == 400 and set(response.json()) == fields, response.json()
    response = client.patch(url, {"auto_rollback": True}, format="json")
    assert response.status_code == 200 and response.json()["auto_rollback"] is True
    assert response.json()["timeline"][-1]["event"] == "auto-rollback on"

    finished_at = timezone.now()
    done = finish(deployment, body["id"], client, now=finished_at)
    assert (done["status"], done["watching"]) == ("succeeded", True)
    assert parse_datetime(done["watch_until"]) == finished_at + timedelta(minutes=2)
    response = client.patch(url, {"auto_rollback": False}, format="json")
    assert response.status_code == 200 and response.json()["watching"] is False
    assert [e.action for e in AuditEvent.objects.filter(action="rollout.update")] == ["rollout.update"] * 2

    # The platform rolls it back (as its watch does on a failing look): the shape CI sees.
    rollout = Rollout.objects.get(pk=body["id"])
    rollback = rollout_watch.roll_back(rollout, rollout.deployment, timezone.now(), "chat-ttft burn rate: new 9.0")
    rolled = client.get(url).json()
    assert (rolled["status"], rolled["rolled_back_by"], rolled["watching"]) == ("rolled_back", rollback.pk, False)
    assert rolled["message"] == "Rolled back by the platform during its watch: chat-ttft burn rate: new 9.0"
    response = client.patch(url, {"auto_rollback": True}, format="json")
    assert response.status_code == 409 and "watch is over" in response.json()["detail"]
    response = client.patch(f"{URL}{rollback.pk}/", {"auto_rollback": False}, format="json")
    assert response.status_code == 409 and "is a rollback" in response.json()["detail"]
    assert client.get(f"{URL}?status=rolled_back").json()["count"] == 1


def test_a_watch_that_is_over_cannot_be_changed(api, deployment):
    client = api("operator")
    body = start(client, watch="1m").json()
    done = finish(deployment, body["id"], client, now=timezone.now() - timedelta(minutes=5))
    assert (done["status"], done["watching"]) == ("succeeded", False)
    response = client.patch(f"{URL}{body['id']}/", {"auto_rollback": False}, format="json")
    assert response.status_code == 409 and "its watch is over" in response.json()["detail"]


def test_a_degradation_level_that_freezes_rollouts_refuses_all_but_rollbacks(api, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(degradation={"level": 2, "name": "shed",
                                                                    "freeze_rollouts": True})
    client = api("operator")
    response = start(client)
    assert response.status_code == 409, response.content
    detail = response.json()["detail"]
    assert "'chat' is at degradation level 2 (shed), which freezes rollouts" in detail
    assert '"rollback": true' in detail and "/api/v1/deployments/chat/degradation/override/" in detail
    assert written() == (0, 0)
    assert start(client, rollback=True).status_code == 201
    assert client.post(f"{URL}undo/", format="json").json()["status"] == "aborted"
    # A direct change of version would be a rollout without analysis: refused too; scaling is not.
    changed = client.patch("/api/v1/deployments/chat/", {"version": 2}, format="json")
    assert changed.status_code == 409 and "version and engine-args changes are refused" in changed.json()["detail"]
    assert client.patch("/api/v1/deployments/chat/", {"replicas": 2}, format="json").status_code == 200
    Deployment.objects.filter(pk=deployment.pk).update(degradation={"level": 1, "name": "cap", "max_tokens_cap": 64})
    assert start(client).status_code == 201  # a level without the action does not freeze
