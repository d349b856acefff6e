"""The compiled CPU kernels (runtime/engine/csrc): built with this machine's C compiler, equal
to the torch code they replace, refusing what they would read out of bounds on, and skipped
with a clear reason where they cannot be built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.engine import kernels, model_runner
from runtime.engine.config import EngineConfig
from runtime.engine.model_runner import attention_kernel
from runtime.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def reference_attention(q, k_cache, v_cache, tables, lens, window=None):
    """SDPA over each row's gathered context: what the kernel must compute."""
    out = torch.empty_like(q)
    _, block_size, kv_heads, head_dim = k_cache.shape
    for row in range(q.shape[0]):
        length = int(lens[row])
        blocks = tables[row].long()
        keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:length]
        values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:length]
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        attended = F.scaled_dot_product_attention(
            q[row].unsqueeze(1).unsqueeze(0),  # [1, heads, 1, dim]
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            enable_gqa=True,
        )
        out[row] = attended[0, :, 0]
    return out


def random_case(*, rows, num_heads, kv_heads, head_dim, block_size, lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 64
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    lens = torch.tensor(lens, dtype=torch.int32)
    width = int(-(-lens.max() // block_size))
    # Each row's blocks scattered through the pool, as after many allocations and frees.
    tables = torch.stack(
        [torch.randperm(num_blocks, generator=generator)[:width] for _ in range(rows)]
    ).to(torch.int32)
    q = torch.randn(rows, num_heads, head_dim, generator=generator)
    return q, k_cache, v_cache, tables, lens


@pytest.fixture(scope="module")
def kernel():
    try:
        return kernels.paged_attention()
    except kernels.KernelUnavailableError as error:
        pytest.skip(f"CPU kernels cannot be built here: {error}")


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,block_size,lens",
    [
        (4, 2, 64, 16, [1, 15, 16, 17, 100, 130]),  # block boundaries, GQA 2
        (4, 4, 64, 4, [3, 9, 40]),  # plain multi-head
        (8, 1, 32, 16, [50, 7]),  # multi-query
        (6, 3, 24, 8, [5, 33, 64]),  # head_dim not a multiple of 8: the portable path
    ],
)
def test_paged_attention_equals_sdpa_over_gathered_blocks(
    kernel, num_heads, kv_heads, head_dim, block_size, lens
):
    q, k_cache, v_cache, tables, lens_t = random_case(
        rows=len(lens), num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, lens=lens,
    )
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, lens_t, out)
    torch.testing.assert_close(out, reference_attention(q, k_cache, v_cache, tables, lens_t),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 200])
def test_paged_attention_sliding_window(kernel, window):
    q, k_cache, v_cache, tables, lens = random_case(
        rows=3, num_heads=4, kv_heads=2, head_dim=64, block_size=16, lens=[3, 40, 97]
    )
    out = torch.empty_like(q)
    kernel(q, k_cache, v_cache, tables, lens, out, window)
    expected = reference_attention(q, k_cache, v_cache, tables, lens, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_writes_into_a_slice_of_a_larger_output(kernel):
    q, k_cache, v_cache, tables, lens = random_case(
        rows=2, num_heads=4, kv_heads=2, head_dim=64, block_size=16, lens=[20, 33]
    )
    out = torch.zeros(5, 4, 64)
    kernel(q, k_cache, v_cache, tables, lens, out[:2])
    torch.testing.assert_close(out[:2], reference_attention(q, k_cache, v_cache, tables, lens),
                               rtol=1e-5, atol=1e-5)
    assert out[2:].abs().sum() == 0
    kernel(q[:0], k_cache, v_cache, tables[:0], lens[:0], out[:0])  # no rows: nothing to do


def test_paged_attention_refuses_what_it_would_read_out_of_bounds(kernel):
    q, k_cache, v_cache, tables, lens = random_case(
        rows=2, num_heads=4, kv_heads=2, head_dim=64, block_size=16, lens=[20, 33]
    )
    out = torch.empty_like(q)
    too_long = lens.clone()
    too_long[1] = tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="longer than its block table"):
        kernel(q, k_cache, v_cache, tables, too_long, out)
    outside = tables.clone()
    outside[0, 0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        kernel(q, k_cache, v_cache, outside, lens, out)
    outside[0, 0] = -1
    with pytest.raises(ValueError, match="outside the cache"):
        kernel(q, k_cache, v_cache, outside, lens, out)
    with pytest.raises(ValueError, match="float32"):
        kernel(q.double(), k_cache, v_cache, tables, lens, out)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, k_cache, v_cache, tables.long(), lens, out)
    with pytest.raises(ValueError, match="mismatched shapes"):
        kernel(q, k_cache, v_cache, tables, lens, torch.empty(3, 4, 64))


def test_engine_output_is_the_same_with_the_kernel_and_with_torch(make_engine, kernel):
    # Mixed lengths across block boundaries (4 tokens), decoding while other prompts prefill.
    mixed = [[1] + [(i * 7 + n) % 200 + 3 for i in range(n)] for n in (37, 5, 22, 2, 13)]
    with_torch = make_engine(attention_backend="torch")
    with_kernel = make_engine(attention_backend="kernel")
    assert with_torch.runner.attention_kernel is None
    assert isinstance(with_kernel.runner.attention_kernel, kernels.PagedAttention)
    assert with_kernel.generate(mixed, GREEDY) == with_torch.generate(mixed, GREEDY)


def test_without_a_compiler_auto_falls_back_and_kernel_refuses(tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(model_runner.logger, "warning", lambda *args: warnings.append(args))
    monkeypatch.setenv("INFEROPS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels.load.cache_clear()
    kernels.paged_attention.cache_clear()
    try:
        assert attention_kernel("auto", torch.float32) is None
        message, reason = warnings[0]
        assert "falls back to torch" in message and "no-such-compiler" in reason
        with pytest.raises(ValueError, match="attention backend 'kernel' cannot run here"):
            attention_kernel("kernel", torch.float32)
    finally:
        kernels.load.cache_clear()
        kernels.paged_attention.cache_clear()
    assert attention_kernel("torch", torch.float32) is None


def test_kernel_is_float32_only_and_unknown_backends_are_refused():
    assert attention_kernel("auto", torch.bfloat16) is None
    with pytest.raises(ValueError, match="float32 only"):
        attention_kernel("kernel", torch.bfloat16)
    with pytest.raises(ValueError, match="attention_backend must be auto, kernel or torch"):
        EngineConfig(model="unused", attention_backend="cuda")


def test_a_failing_build_says_why_and_leaves_no_partial_file(tmp_path, monkeypatch):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                        "echo 'error: this compiler is broken' >&2\nexit 1\n")
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("INFEROPS_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CC", str(compiler))
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelUnavailableError, match="this compiler is broken"):
            kernels.load()
    finally:
        kernels.load.cache_clear()
    assert list(cache.iterdir()) == []


def test_kernels_share_torchs_openmp_runtime(kernel):
    # A second OpenMP runtime would start its own threads beside torch's and oversubscribe
    # the cores; the library must bind to the libgomp torch already loaded.
    maps = open("/proc/self/maps").read().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes
