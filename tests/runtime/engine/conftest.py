"""Engine test fixtures.

The tiny checkpoint builders live in tests/checkpoints.py and the session-scoped fixtures
`checkpoint_factory` and `tiny_llama_dir` in tests/conftest.py (shared with the registry and
server tests); this file only adds what the engine and replica server suites need on top.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.config import EngineConfig
from runtime.engine.engine import LLMEngine
from tests.runtime.engine.replica_http import MAX_MODEL_LEN, make_client, wait_ready

torch.set_num_threads(2)


@pytest.fixture
def make_engine(tiny_llama_dir):
    """LLMEngine over the tiny Llama (or another checkpoint dir) with small test defaults."""

    def make(model_dir=None, **options) -> LLMEngine:
        defaults = {"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 64}
        defaults.update(options)
        return LLMEngine(EngineConfig(model=str(model_dir or tiny_llama_dir), **defaults))

    return make


# ---------------------------------------------------------------------------------------------
# The replica server's HTTP tests (test_server_http_*.py, test_server_options.py)


@pytest.fixture
def engine(make_engine):
    """The real LLMEngine on the tiny Llama; the server drives it from its own thread."""
    return make_engine(max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture
def seen_params(engine) -> list:
    """The SamplingParams of each request the engine took, in order (its own add_request runs)."""
    seen = []
    add_request = engine.add_request

    def recording(request_id, prompt_token_ids, params, priority=0, **slo):
        add_request(request_id, prompt_token_ids, params, priority=priority, **slo)
        seen.append(params)

    engine.add_request = recording
    return seen


@pytest.fixture
def client(engine):
    """The replica server on `engine`, ready, with an admin token and a 2 KB body limit."""
    test_client, _ = make_client(lambda: engine, admin_token="s3cret", max_body_bytes=2048)
    with test_client:
        wait_ready(test_client)
        yield test_client
