"""Deployments REST API: the contract CI builds on, roles, and every bad input refused cleanly."""

from __future__ import annotations

import pytest

from deployments.models import Deployment
from inferops.models import AuditEvent
from registry import services as registry_services
from registry.models import RegisteredModel
from tests.deployments.conftest import make_version
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db


@pytest.fixture
def tiny_model(make_user, tiny_llama_dir):
    actor = make_user("operator", username="registrar")
    model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    v1 = registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    v2 = registry_services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=actor)
    registry_services.alias_set(model=model, name="champion", version=v1, actor=actor)
    return model, v1, v2


def create(client, **body):
    payload = {"name": "chat", "model": "tiny", "version": 1, "replicas": 2, **body}
    return client.post("/api/v1/deployments/", {k: v for k, v in payload.items() if v is not None}, format="json")


def test_create_get_list_contract(api, tiny_model):
    client = api("operator")
    response = create(client, engine_args={"max_num_seqs": 8, "fault_ttft_ms": 200},
                      resources={"gpu_type": "nvidia-l4", "gpu_count": 1, "memory": "16Gi"})
    assert response.status_code == 201, response.content
    body = response.json()
    assert {k: body[k] for k in ("name", "model", "version", "replicas", "ready_replicas", "status")} == {
        "name": "chat", "model": "tiny", "version": 1, "replicas": 2, "ready_replicas": 0, "status": "pending",
    }
    assert body["up_to_date"] is False and body["min_replicas"] == 2 and body["max_replicas"] == 2
    assert client.get("/api/v1/deployments/chat/").json()["engine_args"] == {"max_num_seqs": 8, "fault_ttft_ms": 200}
    assert [d["name"] for d in client.get("/api/v1/deployments/?model=tiny").json()["results"]] == ["chat"]
    assert client.get("/api/v1/deployments/chat/replicas/").json() == []
    assert AuditEvent.objects.filter(action="deployment.create").count() == 1


def test_alias_is_resolved_and_pinned(api, tiny_model):
    model, v1, v2 = tiny_model
    client = api("operator")
    assert create(client, version=None, alias="champion").json()["version"] == 1
    registry_services.alias_set(model=model, name="champion", version=v2, actor=None)
    assert client.get("/api/v1/deployments/chat/").json()["version"] == 1  # pinned at creation
    response = client.patch("/api/v1/deployments/chat/", {"alias": "champion"}, format="json")
    assert response.json()["version"] == 2 and response.json()["alias"] == "champion"


def test_scale_pause_and_change_version(api, tiny_model):
    client = api("operator")
    create(client)
    response = client.patch("/api/v1/deployments/chat/", {"replicas": 3, "paused": True, "version": 2},
                            format="json")
    assert response.status_code == 200
    body = response.json()
    assert (body["replicas"], body["max_replicas"], body["paused"], body["version"]) == (3, 3, True, 2)
    update = AuditEvent.objects.get(action="deployment.update")
    assert update.before["replicas"] == 2 and update.after["replicas"] == 3


def test_roles(api, tiny_model):
    assert api(None).get("/api/v1/deployments/").status_code == 401
    assert api("viewer").get("/api/v1/deployments/").status_code == 200
    assert create(api("viewer")).status_code == 403


@pytest.mark.parametrize("body,field,fragment", [
    ({"model": "nope"}, "model", "No registered model"),
    ({"version": 9}, "version", "no version 9"),
    ({"version": None, "alias": "missing"}, "alias", "no alias 'missing'"),
    ({"version": 1, "alias": "champion"}, "version", "not both"),
    ({"version": None}, "version", "Give the version"),
    ({"backend": "tgi"}, "backend", "not a valid choice"),
    ({"replicas": -1}, "replicas", "greater than or equal to 0"),
    ({"replicas": "two"}, "replicas", "valid integer"),
    ({"replicas": 3, "min_replicas": 1, "max_replicas": 2}, "replicas", "between"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas", "exceeds"),
    ({"engine_args": {"max_num_seqs": "many"}}, "engine_args", "max_num_seqs"),
    ({"engine_args": {"warp_drive": True}}, "engine_args", "warp_drive: not an option"),
    ({"engine_args": {"port": 9000}}, "engine_args", "port: set by inferops"),
    ({"engine_args": {"no_prefix_caching": "yes"}}, "engine_args", "true or false"),
    ({"engine_args": ["max_num_seqs"]}, "engine_args", "dictionary"),
    ({"backend": "vllm", "engine_args": {"fault_ttft_ms": 10}}, "engine_args", "not a vLLM option"),
    ({"backend": "vllm", "engine_args": {"gpu_memory_utilization": "lots"}}, "engine_args", "number"),
    ({"resources": {"gpus": 2}}, "resources", "unknown"),
    ({"resources": {"gpu_count": -1}}, "resources", ">= 0"),
    ({"name": "Bad_Name"}, "name", "lowercase"),
])
def test_bad_input_is_400_and_stores_nothing(api, tiny_model, body, field, fragment):
    response = create(api("operator"), **body)
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert fragment in str(response.json()[field]), response.json()
    assert not Deployment.objects.exists() and not AuditEvent.objects.filter(action__startswith="deployment").exists()


def test_duplicate_unknown_and_unchangeable(api, tiny_model):
    client = api("operator")
    create(client)
    assert create(client).status_code == 409
    assert client.get("/api/v1/deployments/nope/").status_code == 404
    assert client.patch("/api/v1/deployments/nope/", {"replicas": 1}, format="json").status_code == 404
    response = client.patch("/api/v1/deployments/chat/", {"backend": "vllm", "name": "x"}, format="json")
    assert response.status_code == 400 and set(response.json()) == {"backend", "name"}
    response = client.generic("PATCH", "/api/v1/deployments/chat/", "{oops", content_type="application/json")
    assert response.status_code == 400


def test_every_problem_of_a_create_is_named_in_one_400(api, tiny_model):
    client = api("operator")
    create(client)
    response = create(client, version=9, min_replicas=3, max_replicas=2, engine_args={"no_such_option": 1},
                      resources={"gpus": 2})
    assert response.status_code == 400
    errors = response.json()
    assert set(errors) == {"name", "version", "min_replicas", "engine_args", "resources"}, errors
    assert errors["name"] == ["A deployment named 'chat' already exists."]
    assert Deployment.objects.count() == 1


def test_delete_marks_for_draining(api, tiny_model):
    client = api("operator")
    create(client)
    response = client.delete("/api/v1/deployments/chat/")
    assert response.status_code == 202 and response.json()["status"] == "deleting"
    assert client.patch("/api/v1/deployments/chat/", {"replicas": 1}, format="json").status_code == 409


@pytest.mark.parametrize("query,field", [
    ("series=bogus", "series"),
    ("series=ttft_p95&start=yesterday", "start"),
    ("series=ttft_p95&step=5", "step"),
    ("series=ttft_p95&step=abc", "step"),
    ("series=ttft_p95&start=2026-01-02T00:00:00Z&end=2026-01-01T00:00:00Z", "start"),
    ("series=ttft_p95&start=2020-01-01T00:00:00Z&step=15", "step"),
    ("series=ttft_p95&version=v2", "version"),
])
def test_metrics_query_validation(api, tiny_model, query, field):
    client = api("viewer")
    create(api("operator"))
    response = client.get(f"/api/v1/deployments/chat/metrics/?{query}")
    assert response.status_code == 400 and field in response.json()


def test_changing_a_deployment_during_a_rollout_is_a_409_the_schema_names(api):
    # Found by the REST fuzzer (issue 40): the 409 was answered but not in the schema.
    model = RegisteredModel.objects.create(name="tiny", task="generate")
    make_version(model, 1)
    make_version(model, 2)
    operator = api("operator")
    assert create(operator, name="chat", model="tiny", version=1).status_code == 201
    assert operator.post("/api/v1/deployments/chat/rollouts/", {"version": 2}, format="json").status_code == 201
    response = operator.patch("/api/v1/deployments/chat/", {"version": 2}, format="json")
    assert response.status_code == 409
    assert_answer_matches_schema(response, "PATCH", "/api/v1/deployments/{name}/")
