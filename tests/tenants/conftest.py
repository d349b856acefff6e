"""Fixtures of the tenants suite: a clean Redis state for keys and usage, event builders."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from inferops.redis_client import redis_client
from runtime.gateway.contract import KEYS_GENERATION_KEY
from tenants import ingest, publish

OWN_KEYS = (publish.KEYS_KEY, KEYS_GENERATION_KEY, ingest.STREAM_KEY, ingest.REJECTED_KEY)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # PBKDF2 costs a second per test user on a busy 2-core machine; these tests are not about it.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def deployments(db):
    """Deployments `chat` and `embed` as rows only: keys scope to names, nothing needs to serve."""
    from deployments.models import Deployment
    from registry.models import ModelVersion, RegisteredModel

    model = RegisteredModel.objects.create(name="tiny", task="generate")
    # Facts as a registration would read them from a tiny checkpoint; no file is read here.
    version = ModelVersion.objects.create(
        model=model, number=1, artifact_uri="/nonexistent/tiny", digest="0" * 64, architecture="LlamaForCausalLM",
        parameter_count=1000, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=320, max_context=256, dtype="float32", weight_bytes=4000, kv_cache_bytes_per_token=512,
        has_tokenizer=True, has_chat_template=True)
    for name in ("chat", "embed"):
        Deployment.objects.create(name=name, model=model, version=version)
    return ["chat", "embed"]


@pytest.fixture
def redis_conn():
    client = redis_client()
    client.delete(*OWN_KEYS)
    yield client
    client.delete(*OWN_KEYS)


def usage_event(**overrides) -> dict:
    """One event as the gateway writes it (the contract's fields), successful by default."""
    event = {
        "request_id": f"gw-{uuid.uuid4().hex}", "time": time.time(), "tenant": "acme", "key_prefix": "0a1b2c3d",
        "deployment": "chat", "version": 1, "replica": 7, "failed_replica": None, "priority": 0, "endpoint": "chat",
        "stream": True,
        "prompt_tokens": 12, "completion_tokens": 30, "ttft_ms": 40.0, "tpot_ms": 8.0, "e2e_ms": 272.0,
        "status": 200, "finish_reason": "stop", "error_kind": None, "retries": 0,
    }
    event.update(overrides)
    return event


def xadd_events(client, events) -> list[bytes]:
    with client.pipeline(transaction=False) as pipe:
        for event in events:
            pipe.xadd(ingest.STREAM_KEY, {"e": json.dumps(event)})
        return pipe.execute()


# The browser suite's Chromium fixtures, for the console test of this app.
from tests.browser.conftest import browser, page  # noqa: E402,F401
