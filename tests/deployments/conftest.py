"""Fixtures shared by the deployment and rollout tests."""

from __future__ import annotations

import pytest

from registry.models import ModelVersion, RegisteredModel


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def make_version(model: RegisteredModel, number: int) -> ModelVersion:
    """A version row without a checkpoint: neither the API nor the console opens it."""
    return ModelVersion.objects.create(
        model=model, number=number, artifact_uri="/nowhere", digest=f"{number}" * 64,
        architecture="LlamaForCausalLM", parameter_count=1, hidden_size=64, num_layers=2, num_attention_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=320, max_context=256, dtype="float32", weight_bytes=4,
        kv_cache_bytes_per_token=512, has_tokenizer=True, has_chat_template=True,
    )
