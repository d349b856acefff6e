"""What the batch tests share: deployments, a tenant with keys, a storage folder of the test's own."""

from __future__ import annotations

import json

import pytest

from deployments import services as deployment_services
from registry import services as registry_services
from tenants import services as tenant_services
from tests.e2e.conftest import private_redis  # noqa: F401 - a fixture the end-to-end tests here use


@pytest.fixture
def batch_storage(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "batch_files": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": tmp_path / "batch-files"}}}
    return tmp_path / "batch-files"


@pytest.fixture
def batch_setup(db, make_user, tiny_llama_dir, batch_storage):
    """Deployments `chat` (generate) and `embed` (embeddings); tenant acme's keys: every deployment,
    `chat` only, and a revoked one; tenant rival's key."""
    from runtime.engine.encoder import find_packaged_minilm

    actor = make_user("operator")
    chat_model = registry_services.model_create(name="tiny", task="generate", actor=actor)
    registry_services.version_register(model=chat_model, artifact_uri=str(tiny_llama_dir), actor=actor)
    embed_model = registry_services.model_create(name="minilm", task="embed", actor=actor)
    registry_services.version_register(model=embed_model, artifact_uri=str(find_packaged_minilm()), actor=actor)
    chat = deployment_services.deployment_create(name="chat", model=chat_model, version=1, replicas=1, actor=actor)
    embed = deployment_services.deployment_create(name="embed", model=embed_model, version=1, replicas=1,
                                                  actor=actor)
    acme = tenant_services.tenant_create(name="acme", actor=actor)
    rival = tenant_services.tenant_create(name="rival", actor=actor)
    _, every = tenant_services.key_create(tenant=acme, name="every", actor=actor)
    _, chat_only = tenant_services.key_create(tenant=acme, name="chat-only", actor=actor, deployments=["chat"])
    revoked_row, revoked = tenant_services.key_create(tenant=acme, name="old", actor=actor)
    tenant_services.key_revoke(key=revoked_row, actor=actor)
    _, rival_key = tenant_services.key_create(tenant=rival, name="rival", actor=actor)
    return {"actor": actor, "chat": chat, "embed": embed, "acme": acme, "rival": rival, "every": every,
            "chat_only": chat_only, "revoked": revoked, "rival_key": rival_key}


def chat_lines(count: int, model: str = "chat", max_tokens: int = 4) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": max_tokens,
                 "temperature": 0}}).encode() + b"\n" for i in range(count))


def embedding_lines(count: int, model: str = "embed") -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
        "body": {"model": model, "input": f"document number {i}"}}).encode() + b"\n" for i in range(count))
