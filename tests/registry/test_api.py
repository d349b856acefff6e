"""The registry's REST API as CI uses it: roles, registration, aliases, audit, and bad input."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
from django.db import connection

from inferops.models import AuditEvent
from registry.models import Alias, ModelVersion, RegisteredModel

pytestmark = pytest.mark.django_db


def create_model(client, name="llama-tiny", task="generate", **extra):
    return client.post("/api/v1/models/", {"name": name, "task": task, **extra}, format="json")


def register(client, directory, name="llama-tiny", **extra):
    return client.post(f"/api/v1/models/{name}/versions/", {"artifact_uri": str(directory), **extra},
                       format="json")


def stored_counts():
    return (RegisteredModel.objects.count(), ModelVersion.objects.count(), Alias.objects.count(),
            AuditEvent.objects.count())


def test_no_credentials_is_401_and_wrong_role_is_403(api):
    assert api(None).get("/api/v1/models/").status_code == 401
    viewer = api("viewer")
    assert viewer.get("/api/v1/models/").status_code == 200
    response = create_model(viewer)
    assert response.status_code == 403
    assert "operator" in response.json()["detail"]
    assert api("operator").get("/api/v1/audit/").status_code == 403
    assert api("admin").get("/api/v1/audit/").status_code == 200


def test_bad_token_is_401(api):
    client = api(None)
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert client.get("/api/v1/models/").status_code == 401


def test_register_version_with_facts_digest_and_numbering(api, tiny_llama_dir):
    client = api("operator")
    response = create_model(client, description="tiny test", owner="ml-platform", tags=["test", "llama"])
    assert response.status_code == 201, response.content
    assert response.json()["tags"] == ["test", "llama"]

    first = register(client, tiny_llama_dir)
    assert first.status_code == 201, first.content
    body = first.json()
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert body["number"] == 1
    assert body["architecture"] == "LlamaForCausalLM"
    assert body["hidden_size"] == config["hidden_size"]
    assert body["num_layers"] == config["num_hidden_layers"]
    assert body["num_kv_heads"] == config["num_key_value_heads"]
    assert len(body["digest"]) == 64
    assert {entry["path"] for entry in body["manifest"]} >= {"config.json", "model.safetensors"}

    second = register(client, tiny_llama_dir, sha256=body["digest"].upper())
    assert second.status_code == 201
    assert second.json()["number"] == 2
    listing = client.get("/api/v1/models/llama-tiny/versions/").json()
    assert [v["number"] for v in listing["results"]] == [2, 1]
    assert client.get("/api/v1/models/llama-tiny/versions/1/").json()["digest"] == body["digest"]
    assert client.get("/api/v1/models/llama-tiny/").json()["latest_version"] == 2


def test_alias_move_returns_previous_and_is_audited(api, tiny_llama_dir):
    client = api("operator")
    create_model(client)
    register(client, tiny_llama_dir)
    register(client, tiny_llama_dir)
    first = client.put("/api/v1/models/llama-tiny/aliases/champion/", {"version": 1}, format="json")
    assert first.status_code == 200
    assert first.json()["previous_version"] is None
    moved = client.put("/api/v1/models/llama-tiny/aliases/champion/", {"version": 2}, format="json")
    assert moved.json() | {"updated_at": None} == {
        "alias": "champion", "model": "llama-tiny", "version": 2, "previous_version": 1, "updated_at": None,
    }
    assert client.get("/api/v1/models/llama-tiny/aliases/champion/").json()["number"] == 2
    assert client.get("/api/v1/models/llama-tiny/").json()["aliases"] == {"champion": 2}
    assert client.get("/api/v1/models/llama-tiny/versions/2/").json()["aliases"] == ["champion"]

    events = api("admin").get("/api/v1/audit/?action=alias.set").json()["results"]
    assert [e["after"]["version_number"] for e in events] == [2, 1]
    # The move records where the alias pointed before it; the first set had nothing before it.
    first_version = ModelVersion.objects.get(model__name="llama-tiny", number=1)
    assert events[0]["before"]["version"] == first_version.pk and events[1]["before"] is None
    assert events[0]["actor_name"] == "operator-api"

    assert client.delete("/api/v1/models/llama-tiny/aliases/champion/").status_code == 204
    assert client.get("/api/v1/models/llama-tiny/aliases/champion/").status_code == 404
    assert AuditEvent.objects.filter(action="alias.delete").count() == 1


def test_every_write_is_audited(api, tiny_llama_dir):
    client = api("operator")
    create_model(client)
    register(client, tiny_llama_dir)
    client.patch("/api/v1/models/llama-tiny/", {"owner": "search-team"}, format="json")
    actions = list(AuditEvent.objects.order_by("id").values_list("action", flat=True))
    assert actions == ["model.create", "version.register", "model.update"]
    update = AuditEvent.objects.get(action="model.update")
    assert (update.before["owner"], update.after["owner"]) == ("", "search-team")


def test_duplicate_model_is_409_and_stores_nothing(api):
    client = api("operator")
    assert create_model(client).status_code == 201
    before = stored_counts()
    response = create_model(client)
    assert response.status_code == 409
    assert "already exists" in response.json()["detail"]
    assert stored_counts() == before


@pytest.mark.parametrize("body,field", [
    ({"name": "Bad Name!", "task": "generate"}, "name"),
    ({"name": "ok", "task": "summarise"}, "task"),
    ({"name": "ok"}, "task"),
    ({"name": 12, "task": "generate", "tags": "not-a-list"}, "tags"),
    ({"name": "ok", "task": "generate", "tags": ["UPPER CASE"]}, "tags"),
])
def test_bad_model_bodies_are_400_naming_the_field(api, body, field):
    before = stored_counts()
    response = api("operator").post("/api/v1/models/", body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert stored_counts() == before


def test_malformed_json_and_huge_body(api):
    client = api("operator")
    response = client.generic("POST", "/api/v1/models/", "{not json", content_type="application/json")
    assert response.status_code == 400
    assert "JSON parse error" in response.json()["detail"]
    huge = json.dumps({"name": "big", "task": "generate", "description": "x" * (2 * 1024 * 1024)})
    response = client.generic("POST", "/api/v1/models/", huge, content_type="application/json")
    assert response.status_code == 413
    assert "limit" in response.json()["detail"]
    assert RegisteredModel.objects.count() == 0


def truncate_weights(directory):
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])


def corrupt_config(directory):
    (directory / "config.json").write_text("{oops")


def unsupported_arch(directory):
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (corrupt_config, "not valid JSON"),
    (unsupported_arch, "unsupported architecture 'FalconForCausalLM'"),
    (truncate_weights, "truncated"),
])
def test_bad_checkpoints_are_400_and_store_nothing(api, tiny_llama_dir, tmp_path, mutate, fragment):
    client = api("operator")
    create_model(client)
    directory = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, directory)
    mutate(directory)
    before = stored_counts()
    response = register(client, directory)
    assert response.status_code == 400
    assert fragment in response.json()["artifact_uri"][0]
    assert stored_counts() == before


@pytest.mark.parametrize("uri,fragment", [
    ("/no/such/checkpoint", "no such directory"),
    ("s3://bucket/llama", "cannot be validated"),
])
def test_bad_uris_are_400(api, uri, fragment):
    client = api("operator")
    create_model(client)
    before = stored_counts()
    response = client.post("/api/v1/models/llama-tiny/versions/", {"artifact_uri": uri}, format="json")
    assert response.status_code == 400
    assert fragment in response.json()["artifact_uri"][0]
    assert stored_counts() == before


def test_digest_mismatch_is_refused(api, tiny_llama_dir):
    client = api("operator")
    create_model(client)
    before = stored_counts()
    response = register(client, tiny_llama_dir, sha256="0" * 64)
    assert response.status_code == 400
    assert "digest mismatch" in response.json()["sha256"][0]
    assert stored_counts() == before
    response = register(client, tiny_llama_dir, sha256="xyz")
    assert response.status_code == 400 and "64 hexadecimal" in response.json()["sha256"][0]


def test_encoder_under_generate_model_is_refused(api, tiny_llama_dir):
    client = api("operator")
    create_model(client, name="embedder", task="embed")
    response = register(client, tiny_llama_dir, name="embedder")
    assert response.status_code == 400
    assert "task 'generate'" in response.json()["artifact_uri"][0]


def test_unknown_names_are_404(api, tiny_llama_dir):
    client = api("operator")
    assert client.get("/api/v1/models/nope/").status_code == 404
    assert register(client, tiny_llama_dir, name="nope").status_code == 404
    create_model(client)
    assert client.get("/api/v1/models/llama-tiny/versions/7/").status_code == 404
    assert client.get("/api/v1/models/llama-tiny/aliases/champion/").status_code == 404
    assert client.put("/api/v1/models/llama-tiny/aliases/champion/", {"version": 3},
                      format="json").status_code == 404
    assert client.delete("/api/v1/models/llama-tiny/aliases/champion/").status_code == 404


def test_bad_alias_input(api, tiny_llama_dir):
    client = api("operator")
    create_model(client)
    register(client, tiny_llama_dir)
    assert client.put("/api/v1/models/llama-tiny/aliases/Not_A_Slug/", {"version": 1},
                      format="json").status_code == 400
    response = client.put("/api/v1/models/llama-tiny/aliases/champion/", {"version": "one"}, format="json")
    assert response.status_code == 400 and "version" in response.json()
    assert Alias.objects.count() == 0


def test_list_filters_and_pagination(api):
    client = api("operator")
    create_model(client, name="chat-a", tags=["chat"], owner="team-a")
    create_model(client, name="chat-b", tags=["chat"], owner="team-b")
    create_model(client, name="embedder", task="embed")
    names = lambda r: [m["name"] for m in r.json()["results"]]  # noqa: E731
    assert names(client.get("/api/v1/models/?task=embed")) == ["embedder"]
    assert names(client.get("/api/v1/models/?tag=chat")) == ["chat-a", "chat-b"]
    assert names(client.get("/api/v1/models/?search=chat&owner=team-b")) == ["chat-b"]
    page = client.get("/api/v1/models/?limit=2").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and page["next"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_registrations_get_distinct_numbers(api, tiny_llama_dir):
    client = api("operator")
    create_model(client)
    token = client._credentials["HTTP_AUTHORIZATION"]
    results = []

    def worker():
        from rest_framework.test import APIClient

        own = APIClient()
        own.credentials(HTTP_AUTHORIZATION=token)
        results.append(register(own, tiny_llama_dir).status_code)
        connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [201] * 4
    numbers = sorted(ModelVersion.objects.values_list("number", flat=True))
    assert numbers == [1, 2, 3, 4]
