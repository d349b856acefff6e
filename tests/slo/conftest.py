"""Fixtures of the SLO suite: a deployment without a checkpoint, usage events stored through ingest."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest

from deployments.models import Deployment
from registry.models import ModelVersion, RegisteredModel

NOW = datetime(2026, 3, 10, 12, 0, 30, tzinfo=UTC)  # a Tuesday, mid-minute
_ids = itertools.count()


def make_deployment(name: str = "chat", model_name: str = "tiny") -> Deployment:
    model, _ = RegisteredModel.objects.get_or_create(name=model_name, defaults={"task": "generate"})
    version = model.versions.first() or ModelVersion.objects.create(
        model=model, number=1, artifact_uri="/nowhere", digest="0" * 64, architecture="LlamaForCausalLM",
        parameter_count=1, hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=320, max_context=256, dtype="float32", weight_bytes=4, kv_cache_bytes_per_token=512,
        has_tokenizer=True, has_chat_template=True,
    )
    return Deployment.objects.create(name=name, model=model, version=version)


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """The role fixtures create users; PBKDF2 at full strength costs seconds on a busy 2-core host."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def deployment(db) -> Deployment:
    return make_deployment()


def event(time: datetime, **fields) -> dict:
    """One usage event: a successful streamed request by default (the contract's fields)."""
    row = {
        "request_id": f"req-{next(_ids)}", "time": time, "tenant": "acme", "key_prefix": "0a1b2c3d",
        "deployment": "chat", "version": 1, "replica": 1, "endpoint": "chat", "stream": True, "prompt_tokens": 10,
        "completion_tokens": 20, "ttft_ms": 100.0, "tpot_ms": 10.0, "e2e_ms": 300.0, "status": 200,
        "finish_reason": "stop", "error_kind": None, "retries": 0,
    }
    row.update(fields)
    return row


def insert_events(rows: list[dict]) -> None:
    """Stored by the usage ledger's own ingest, so the usage pipeline folds them as it would."""
    from tenants.ingest import store_events

    events = []
    for row in rows:
        row = {name: value for name, value in row.items() if name != "ingested_at"}  # set by ingest
        events.append({**row, "time": row["time"].timestamp()})
    store_events(events)


@pytest.fixture
def add_events(db):
    """add_events(minute_time, good=n, bad=m, **fields): n successful and m 5xx requests."""

    def add(time: datetime, good: int = 0, bad: int = 0, **fields) -> None:
        rows = [event(time, **fields) for _ in range(good)]
        rows += [event(time, **{**fields, "status": 503, "error_kind": "upstream_error"}) for _ in range(bad)]
        insert_events(rows)

    return add
