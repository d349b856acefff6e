"""The weight matmul (`Linear`): oneDNN's packed weights and the torch fallback agree with F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.config import EngineConfig
from runtime.engine.model import Linear, padded_rows
from runtime.engine.plan import linear_backend, onednn_packs

ONEDNN = torch.backends.mkldnn.is_available()
BACKENDS = [
    pytest.param("onednn", marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN")),
    "torch",
]


# oneDNN packs bf16 weights only on CPUs with AVX512BW/VL/DQ or AVX-NE-CONVERT; `auto` must
# then fall back to torch, which the "auto" case checks there.
BF16_BACKENDS = [
    pytest.param("onednn", marks=pytest.mark.skipif(
        not onednn_packs(torch.bfloat16), reason="oneDNN cannot pack bf16 weights on this CPU")),
    "auto",
    "torch",
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_backend_computes_f_linear(backend, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 40, generator=generator)
    linear = Linear(weight, bias, backend=backend)
    assert linear.backend == backend
    out = linear(x)
    assert out.shape == (rows, 96)
    # fp32 throughout; only the order of the sums differs from MKL's.
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_fallback_and_strided_input(backend):
    weight = torch.randn(500, 32)
    rows = torch.randn(20, 32)[::2]  # every other row: not contiguous
    linear = Linear(weight, backend=backend, transposed_fallback=True)
    torch.testing.assert_close(linear(rows), rows @ weight.t(), rtol=1e-5, atol=1e-5)
    if backend == "torch":
        assert linear.weight_t is not None and linear.weight_t.is_contiguous()


def test_auto_falls_back_where_onednn_cannot_run_the_dtype():
    # oneDNN has an fp16 path only on CPUs with AVX512-FP16 / AVX-NE-CONVERT; on others `auto`
    # must fall back to F.linear rather than fail to load the model.
    weight = torch.randn(16, 8).half()
    x = torch.randn(3, 8).half()
    linear = Linear(weight, backend=linear_backend("auto", torch.float16, onednn_packs))
    assert linear.backend == ("onednn" if onednn_packs(torch.float16) else "torch")
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BF16_BACKENDS)
def test_bf16_weights_take_float32_input_and_return_float32(backend):
    # The engine's bf16 mode: float32 activations, each matmul in the weight's dtype.
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 48, generator=generator).bfloat16()
    bias = torch.randn(64, generator=generator).bfloat16()
    x = torch.randn(9, 48, generator=generator)
    linear = Linear(weight, bias, backend=linear_backend(backend, torch.bfloat16, onednn_packs))
    if backend == "auto":
        assert linear.backend == ("onednn" if onednn_packs(torch.bfloat16) else "torch")
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (9, 64)
    expected = F.linear(x.bfloat16(), weight, bias).float()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="linear backend must be onednn or torch"):
        Linear(torch.randn(4, 4), backend="auto")  # resolved by the plan, never by a layer
    with pytest.raises(ValueError, match="linear_backend must be auto, onednn or torch"):
        EngineConfig(model="unused", linear_backend="cuda")


def test_row_padding_bounds_the_shapes_and_the_waste():
    sizes = [padded_rows(rows) for rows in range(1, 4097)]
    assert sizes[:32] == list(range(1, 33))  # a decode batch runs exactly
    assert all(rows <= size < 1.25 * rows for rows, size in enumerate(sizes, start=1))
    assert sizes == sorted(sizes)
    assert len(set(sizes[:512])) == 48 and len(set(sizes)) == 60


def test_tied_embeddings_are_held_once_by_the_torch_fallback(checkpoint_factory, make_engine):
    model_dir = checkpoint_factory("tied-llama", "llama", seed=1, tie_word_embeddings=True)
    model = make_engine(model_dir, linear_backend="torch").runner.model
    assert model.embed_tokens.data_ptr() == model.lm_head.weight_t.data_ptr()
    assert torch.equal(model.embed_tokens, model.lm_head.weight_t.t())
