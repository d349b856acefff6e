"""Engine test fixtures.

The tiny checkpoint builders live in tests/checkpoints.py and the session-scoped fixtures
`checkpoint_factory` and `tiny_llama_dir` in tests/conftest.py (shared with the registry and
server tests); this file only adds what the engine suites need on top.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.config import EngineConfig
from runtime.engine.engine import LLMEngine

torch.set_num_threads(2)


@pytest.fixture
def make_engine(tiny_llama_dir):
    """LLMEngine over the tiny Llama (or another checkpoint dir) with small test defaults."""

    def make(model_dir=None, **options) -> LLMEngine:
        defaults = {"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 64}
        defaults.update(options)
        return LLMEngine(EngineConfig(model=str(model_dir or tiny_llama_dir), **defaults))

    return make
