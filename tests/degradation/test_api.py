"""PUT/GET /api/v1/deployments/{name}/degradation/ and its override: shapes, roles, bad policies
answered 400 on the field that is wrong, with nothing written."""

from __future__ import annotations

import copy

import pytest

from degradation.models import DegradationPolicy, DegradationState, LevelChange
from inferops.models import AuditEvent
from slo.services import slo_create
from tests.degradation.conftest import LEVELS
from tests.slo.conftest import make_deployment

pytestmark = pytest.mark.django_db
URL = "/api/v1/deployments/chat/degradation/"


@pytest.fixture
def slo(deployment):
    return slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
                      objective=0.99, window="1d")


def test_put_then_get_the_policy_and_its_state(api, deployment, slo, policy_body):
    client = api("operator")
    assert client.get(URL).status_code == 404  # none yet, and the message says how to make one
    response = client.put(URL, policy_body(slos=["chat-ttft"], window="10m", hold_s=120), format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["window"] == "10m" and body["hold_s"] == 120 and body["slos"] == ["chat-ttft"]
    assert body["levels"][1] == {"name": "short-answers", "enter_burn_rate": 20.0, "exit_burn_rate": 10.0,
                                 "actions": {"shed_below_priority": 5, "max_tokens_cap": 64, "freeze_rollouts": True}}
    assert (body["level"], body["level_name"], body["override"], body["history"]) == (0, "normal", None, [])
    assert api("viewer").get(URL).json() == body
    assert AuditEvent.objects.filter(action="degradation.policy").count() == 1
    # PUT replaces.
    assert client.put(URL, policy_body(levels=LEVELS[:1]), format="json").json()["levels"] == [
        {**LEVELS[0], "enter_burn_rate": 5.0, "exit_burn_rate": 2.0}]
    assert len(DegradationPolicy.objects.get(deployment=deployment).levels) == 1


def test_viewers_cannot_change_it(api, deployment, policy_body):
    assert api("viewer").put(URL, policy_body(), format="json").status_code == 403
    assert api(None).get(URL).status_code == 401


def level(index: int, **changes) -> list[dict]:
    levels = copy.deepcopy(LEVELS)
    for path, value in changes.items():
        target = levels[index]
        *parents, last = path.split("__")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[last] = value
    return levels


@pytest.mark.parametrize(("body", "expected"), [
    ({"levels": level(0, exit_burn_rate=6)},
     {"levels": {"0": {"exit_burn_rate": ["must not be above the entry rate"]}}}),
    ({"levels": level(1, enter_burn_rate=4, exit_burn_rate=3)},
     {"levels": {"1": {"enter_burn_rate": ["Levels must increase"]}}}),
    ({"levels": level(1, name="shed-batch")}, {"levels": {"1": {"name": ["Two levels are named"]}}}),
    ({"levels": level(0, actions__fallback={"deployment": "chat", "weight": 50})},
     {"levels": {"0": {"actions": {"fallback": {"deployment": ["cannot fall back to itself"]}}}}}),
    ({"levels": level(0, actions__fallback={"deployment": "nope", "weight": 50})},
     {"levels": {"0": {"actions": {"fallback": {"deployment": ["Unknown deployment 'nope'"]}}}}}),
    ({"levels": level(0, actions__fallback={"deployment": "embedder", "weight": 50})},
     {"levels": {"0": {"actions": {"fallback": {"deployment": ["serves embed requests"]}}}}}),
    ({"levels": level(0, actions__fallback={"deployment": "small"})},
     {"levels": {"0": {"actions": {"fallback": {"weight": ["takes nothing"]}}}}}),
    ({"levels": level(0, actions__scale_up=2)}, {"levels": {"0": {"actions": {"scale_up": ["turn autoscaling on"]}}}}),
    ({"levels": level(0, actions={})}, {"levels": {"0": {"actions": {"non_field_errors": ["at least one action"]}}}}),
    ({"levels": level(0, actions__shed_below=5)}, {"levels": {"0": {"actions": {"shed_below": ["Unknown field."]}}}}),
    ({"levels": level(0, enter_burn_rate="fast")}, {"levels": {"0": {"enter_burn_rate": ["A valid number"]}}}),
    ({"levels": []}, {"levels": ["Give 1 to 8 levels."]}),
    ({"slos": ["nope"]}, {"slos": ["Unknown SLO 'nope'; known for 'chat': chat-ttft."]}),
    ({"slos": ["other-ttft"]}, {"slos": ["SLO 'other-ttft' does not cover 'chat'."]}),
    ({"window": "90s"}, {"window": ["whole minutes from 1m to 1h"]}),
    ({"window": "2h"}, {"window": ["whole minutes from 1m to 1h"]}),
    ({"window": "soon"}, {"window": ["Expected a duration"]}),
    ({"hold_s": -1}, {"hold_s": ["greater than or equal to 0"]}),
    ({"enabeld": False}, {"enabeld": ["Unknown field."]}),
])
def test_bad_policies_are_400_on_the_field_and_write_nothing(api, deployment, slo, policy_body, body, expected):
    make_deployment("small")
    embedder = make_deployment("embedder", model_name="minilm")
    embedder.model.task = "embed"
    embedder.model.save(update_fields=["task"])
    other = make_deployment("other", model_name="other-model")
    slo_create(actor=None, name="other-ttft", deployment=other, sli_kind="latency", ttft_ms=150, objective=0.99,
               window="1d")
    response = api("operator").put(URL, policy_body(**body), format="json")
    assert response.status_code == 400, response.json()
    assert_contains(response.json(), expected)
    assert not DegradationPolicy.objects.exists()


def assert_contains(actual, expected):
    """Each expected message is a fragment of the actual one, at the same place."""
    if isinstance(expected, dict):
        assert set(expected) <= set(actual), (actual, expected)
        for key, value in expected.items():
            assert_contains(actual[key], value)
    elif isinstance(expected, list):
        assert len(actual) == len(expected), (actual, expected)
        for a, e in zip(actual, expected, strict=True):
            assert_contains(a, e)
    else:
        assert expected in actual, (actual, expected)


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b'"level"', b'{"levels": "one"}'])
def test_malformed_bodies_are_400(api, deployment, raw):
    response = api("operator").put(URL, raw, content_type="application/json")
    assert response.status_code == 400


def test_unknown_deployment_is_404(api):
    assert api("operator").get("/api/v1/deployments/nope/degradation/").status_code == 404
    assert api("operator").put("/api/v1/deployments/nope/degradation/", {}, format="json").status_code == 404


def test_override_forces_a_level_and_clearing_hands_back_to_the_policy(api, deployment, policy_body):
    client = api("operator")
    client.put(URL, policy_body(), format="json")
    response = client.post(URL + "override/", {"level": 2, "until": "30m", "reason": "launch"}, format="json")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["level"] == 2 and body["level_name"] == "short-answers"
    assert body["override"]["level"] == 2 and body["override"]["by"] == "operator-api"
    assert body["actions"]["max_tokens_cap"] == 64
    (change,) = body["history"]
    assert (change["from"], change["to"], change["by"]) == (0, 2, "operator-api")

    cleared = client.delete(URL + "override/", {"reason": "done"}, format="json")
    assert cleared.status_code == 200 and cleared.json()["override"] is None
    assert client.delete(URL + "override/", format="json").status_code == 409  # nothing left to clear
    assert AuditEvent.objects.filter(action__startswith="degradation.override").count() == 2


@pytest.mark.parametrize(("body", "field", "fragment"), [
    ({"level": 3, "until": "30m", "reason": "x"}, "level", "levels 0 to 2"),
    ({"level": -1, "until": "30m", "reason": "x"}, "level", "greater than or equal to 0"),
    ({"level": 1, "until": "2020-01-01T00:00:00Z", "reason": "x"}, "until", "in the future"),
    ({"level": 1, "until": "8d", "reason": "x"}, "until", "at most 7 days"),
    ({"level": 1, "until": "whenever", "reason": "x"}, "until", "ISO 8601"),
    ({"level": 1, "until": "30m", "reason": ""}, "reason", "may not be blank"),
    ({"level": 1, "until": "30m"}, "reason", "required"),
])
def test_bad_overrides_are_400(api, deployment, policy_body, body, field, fragment):
    client = api("operator")
    client.put(URL, policy_body(), format="json")
    response = client.post(URL + "override/", body, format="json")
    assert response.status_code == 400 and fragment in response.json()[field][0], response.json()
    assert not LevelChange.objects.exists() and DegradationState.objects.get().override_until is None


def test_override_without_a_policy_is_404(api, deployment):
    response = api("operator").post(URL + "override/", {"level": 0, "until": "1h", "reason": "x"}, format="json")
    assert response.status_code == 404


def test_a_policy_with_fewer_levels_brings_the_deployment_down_at_once(api, deployment, policy_body):
    client = api("operator")
    client.put(URL, policy_body(), format="json")
    client.post(URL + "override/", {"level": 2, "until": "30m", "reason": "drill"}, format="json")
    client.delete(URL + "override/", format="json")
    body = client.put(URL, policy_body(levels=LEVELS[:1]), format="json").json()
    assert body["level"] == 1 and body["actions"]["name"] == "shed-batch"
    body = client.put(URL, policy_body(enabled=False), format="json").json()
    assert body["level"] == 0 and body["actions"] is None and body["history"][0]["reason"] == "policy disabled"
