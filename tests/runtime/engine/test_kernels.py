"""The compiled CPU kernels (runtime/engine/csrc): built with this machine's C compiler, equal
to the torch code they replace, refusing what they would read out of bounds on, and skipped
with the reason in pytest's summary where they cannot be built.

Each numeric test runs twice: on the build for this CPU (its AVX-512 or AVX2 code) and on the
portable build (the plain C loops a CPU without either runs)."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

from runtime.engine import kernels
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


BUILDS = {"native": kernels.CFLAGS, "portable": kernels.PORTABLE_CFLAGS}


@pytest.fixture(scope="module", params=sorted(BUILDS))
def compiled(request) -> kernels.CpuKernels:
    """The kernels of each build, loaded side by side (the engine's is the native one)."""
    reason = kernels.unavailable_reason(BUILDS[request.param])
    if reason is not None:
        pytest.skip(f"{request.param} build: {reason}")
    return kernels.CpuKernels(kernels.load(BUILDS[request.param]))


@pytest.fixture(scope="module")
def native() -> kernels.CpuKernels:
    """What the engine runs: tests of the engine with its kernels need this build."""
    reason = kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return kernels.cpu_kernels()


@pytest.fixture
def kernel(compiled):
    return compiled.paged_attention


@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,block_size,lens",
    [
        (4, 2, 64, 16, [1, 15, 16, 17, 100, 130]),  # block boundaries, GQA 2
        (4, 4, 64, 4, [3, 9, 40]),  # plain multi-head
        (8, 1, 32, 16, [50, 7]),  # multi-query
        (4, 2, 128, 16, [1, 8, 9, 33]),  # head_dim in two 64-float slices
        (2, 1, 96, 16, [23, 40]),  # one 64-float slice, then 8- or 16-float ones
        (6, 2, 24, 16, [17, 70]),  # a multiple of 8, not of 16: AVX2's vectors, AVX-512's loops
        (6, 3, 20, 8, [5, 33, 64]),  # head_dim not a multiple of 8: the portable path
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_equals_sdpa_over_gathered_blocks(
    kernel, num_heads, kv_heads, head_dim, block_size, lens, kv_dtype
):
    q, k_cache, v_cache, tables, lens_t = random_case(
        rows=len(lens), num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, lens=lens,
    )
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    out = torch.full_like(q, float("nan"))
    kernel(q, k_cache, v_cache, tables, lens_t, out)
    # A bf16 cache is read as the float32 values it holds: only summation order differs.
    expected = reference_attention(q, k_cache.float(), v_cache.float(), tables, lens_t)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


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
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel(q.double(), k_cache, v_cache, tables, lens, out)
    with pytest.raises(ValueError, match="KV caches of one dtype"):
        kernel(q, k_cache.bfloat16(), v_cache, tables, lens, out)
    with pytest.raises(ValueError, match="KV caches of one dtype"):
        kernel(q, k_cache.half(), v_cache.half(), tables, lens, out)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, k_cache, v_cache, tables.long(), lens, out)
    with pytest.raises(ValueError, match="mismatched shapes"):
        kernel(q, k_cache, v_cache, tables, lens, torch.empty(3, 4, 64))


def test_the_portable_build_targets_neither_avx2_nor_avx512():
    reason = kernels.unavailable_reason(kernels.PORTABLE_CFLAGS)
    if reason is not None:
        pytest.skip(reason)
    # What the C code's #if picks its paths by: the portable build must take the plain loops
    # even where the compiler's default target has AVX2.
    macros = subprocess.run(
        [kernels.find_compiler(), *kernels.PORTABLE_CFLAGS, "-dM", "-E", "-x", "c", "/dev/null"],
        capture_output=True, text=True, check=True).stdout.split()
    assert "__AVX2__" not in macros and "__AVX512F__" not in macros


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_engine_output_is_the_same_with_the_kernel_and_with_torch(
    make_engine, native, kv_cache_dtype
):
    # Mixed lengths across block boundaries (4 tokens), decoding while other prompts prefill.
    mixed = [[1] + [(i * 7 + n) % 200 + 3 for i in range(n)] for n in (37, 5, 22, 2, 13)]
    with_torch = make_engine(ops_backend="torch", kv_cache_dtype=kv_cache_dtype)
    with_kernel = make_engine(ops_backend="kernels", kv_cache_dtype=kv_cache_dtype)
    assert with_torch.plan.kernels is None
    assert with_kernel.plan.kernels is native
    expected_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
    assert with_kernel.runner.kv_caches[0][1].dtype == expected_dtype
    assert with_torch.runner.kv_caches[0][1].dtype == expected_dtype
    assert with_kernel.generate(mixed, GREEDY) == with_torch.generate(mixed, GREEDY)


def test_without_a_compiler_the_build_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("INFEROPS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelUnavailableError, match="no-such-compiler"):
            kernels.load()
        assert kernels.unavailable_reason().endswith("the kernels' torch fallback runs instead")
        monkeypatch.delenv("CC")
        monkeypatch.setenv("PATH", str(tmp_path))  # neither cc nor gcc
        kernels.load.cache_clear()
        assert kernels.unavailable_reason(kernels.PORTABLE_CFLAGS).startswith("no C compiler (cc")
    finally:
        kernels.load.cache_clear()


def test_prefill_chunks_are_attended_in_the_prefill_dtype():
    from runtime.engine.model import AttentionMetadata, PrefillAttention, paged_attention

    generator = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 64, 4, 8
    # Two chunks in one step: a whole prompt of 6 tokens, then the last 5 tokens of a
    # sequence whose first 7 are in blocks 3 and 4 already.
    q = torch.randn(11, heads, head_dim, generator=generator)
    k = torch.randn(11, kv_heads, head_dim, generator=generator)
    v = torch.randn(11, kv_heads, head_dim, generator=generator)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).bfloat16()
    v_cache = torch.randn(shape, generator=generator).bfloat16()
    blocks = torch.tensor([3, 4, 5])
    slots = torch.tensor([3 * 4 + 3, 4 * 4, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3])  # positions 7-11
    k_cache.view(-1, kv_heads, head_dim)[slots] = k[6:].bfloat16()
    v_cache.view(-1, kv_heads, head_dim)[slots] = v[6:].bfloat16()
    mask = torch.arange(12).unsqueeze(0) <= torch.arange(7, 12).unsqueeze(1)
    chunks = [PrefillAttention(0, 6, None, None), PrefillAttention(6, 11, blocks, mask)]

    def attend(prefill_dtype):
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                                 prefills=chunks, prefill_dtype=prefill_dtype)
        return paged_attention(q, k, v, k_cache, v_cache, meta)

    def sdpa(query, keys, values, **how):
        return F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), enable_gqa=True, **how)[0].transpose(0, 1)

    context_k = k_cache[blocks].reshape(-1, kv_heads, head_dim)
    context_v = v_cache[blocks].reshape(-1, kv_heads, head_dim)
    in_bf16 = attend(torch.bfloat16)
    assert in_bf16.dtype == torch.float32  # handed back in the activations' dtype
    torch.testing.assert_close(in_bf16[:6], sdpa(q[:6].bfloat16(), k[:6].bfloat16(),
                                                 v[:6].bfloat16(), is_causal=True).float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(in_bf16[6:], sdpa(q[6:].bfloat16(), context_k, context_v,
                                                 attn_mask=mask).float(), rtol=0, atol=0)
    in_float32 = attend(None)  # q's dtype: the cache's bf16 values read as float32
    torch.testing.assert_close(in_float32[6:], sdpa(q[6:], context_k.float(), context_v.float(),
                                                    attn_mask=mask))
    torch.testing.assert_close(in_bf16, in_float32, rtol=0, atol=3e-2)


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


def test_an_unwritable_kernel_cache_makes_the_kernels_unavailable(native, tmp_path, monkeypatch):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    monkeypatch.setenv("INFEROPS_KERNEL_CACHE", str(not_a_directory / "kernels"))
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelUnavailableError, match="set INFEROPS_KERNEL_CACHE"):
            kernels.load()
    finally:
        kernels.load.cache_clear()


def test_kernels_share_torchs_openmp_runtime(compiled):
    # A second OpenMP runtime would start its own threads beside torch's and oversubscribe
    # the cores; the library must bind to the libgomp torch already loaded.
    maps = open("/proc/self/maps").read().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def fused_case(rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    num_heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 16, 4, 8
    qkv = torch.randn(rows, (num_heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:rows]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return qkv, cos, sin, slots, shape, num_heads


@pytest.mark.parametrize("rows", [0, 1, 3, 20])  # 20: the rows split across threads
def test_fused_ops_equal_the_torch_ops(compiled, rows):
    from runtime.engine.config import ModelConfig
    from runtime.engine.model import TorchOps

    qkv, cos, sin, slots, shape, num_heads = fused_case(rows)
    torch_ops = TorchOps(ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": num_heads,
        "num_key_value_heads": shape[2],
    }))
    caches = {name: (torch.zeros(shape), torch.zeros(shape)) for name in ("torch", "kernels")}
    results = {
        name: ops.rope_store_kv(qkv, cos, sin, slots, *caches[name], num_heads)
        for name, ops in (("torch", torch_ops), ("kernels", compiled))
    }
    for expected, got in zip(results["torch"], results["kernels"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for expected, got in zip(caches["torch"], caches["kernels"], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    hidden, delta = torch.randn(2, rows, 48).unbind(0)
    weight = torch.randn(48)
    for with_delta in (delta, None):
        mine, theirs = hidden.clone(), hidden.clone()
        out = compiled.add_rms_norm(mine, with_delta, weight, 1e-6)
        torch.testing.assert_close(out, torch_ops.add_rms_norm(theirs, with_delta, weight, 1e-6),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine, theirs)  # the residual was updated in place alike

    gate_up = torch.randn(rows, 2 * 40) * 4
    torch.testing.assert_close(compiled.silu_mul(gate_up), torch_ops.silu_mul(gate_up),
                               rtol=1e-5, atol=1e-5)


def test_keys_and_values_stored_in_a_bf16_cache_round_as_torch_does(compiled):
    from runtime.engine.config import ModelConfig
    from runtime.engine.model import TorchOps

    qkv, cos, sin, slots, shape, num_heads = fused_case(20)
    v_start = (num_heads + shape[2]) * shape[3]
    qkv[0, v_start:v_start + 3] = torch.tensor([float("nan"), float("inf"), 1 + 2**-8])  # tie
    torch_ops = TorchOps(ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": num_heads,
        "num_key_value_heads": shape[2],
    }))
    stored = {}
    for name, ops in (("torch", torch_ops), ("kernels", compiled)):
        k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(
            shape, dtype=torch.bfloat16)
        q, k, v = ops.rope_store_kv(qkv, cos, sin, slots, k_cache, v_cache, num_heads)
        assert q.dtype == k.dtype == torch.float32
        stored[name] = (k, v, k_cache.view(-1, *shape[2:]), v_cache.view(-1, *shape[2:]))
    k, v, k_cache, v_cache = stored["kernels"]
    # Exactly what .to(torch.bfloat16) of the float32 key and value gives (NaN as a NaN: torch
    # itself gives different NaN bits on its scalar and vector paths).
    for cached, computed in ((k_cache, k), (v_cache, v)):
        torch.testing.assert_close(cached[slots], computed.bfloat16(), rtol=0, atol=0,
                                   equal_nan=True)
    torch.testing.assert_close(k_cache.float(), stored["torch"][2].float(), rtol=1e-2, atol=1e-2,
                               equal_nan=True)


def test_fused_ops_refuse_bad_shapes_and_slots(compiled):
    qkv, cos, sin, slots, shape, num_heads = fused_case(5)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    bad = slots.clone()
    bad[2] = shape[0] * shape[1]
    with pytest.raises(ValueError, match="outside the cache"):
        compiled.rope_store_kv(qkv, cos, sin, bad, k_cache, v_cache, num_heads)
    assert k_cache.abs().sum() == 0  # refused before anything was written
    with pytest.raises(ValueError, match="mismatched shapes"):
        compiled.rope_store_kv(qkv, cos, sin, slots, k_cache, v_cache, num_heads + 1)
    with pytest.raises(ValueError, match="mismatched shapes"):
        compiled.rope_store_kv(qkv, cos, sin, slots.int(), k_cache, v_cache, num_heads)
    with pytest.raises(ValueError, match="contiguous float32"):
        compiled.rope_store_kv(qkv[:, :-1], cos, sin, slots, k_cache, v_cache, num_heads)
    with pytest.raises(ValueError, match="KV caches of one dtype"):
        compiled.rope_store_kv(qkv, cos, sin, slots, k_cache, v_cache.bfloat16(), num_heads)
    with pytest.raises(ValueError, match="mismatched shapes"):
        compiled.add_rms_norm(torch.randn(2, 8), torch.randn(2, 4), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous float32"):
        compiled.add_rms_norm(torch.randn(2, 8).double(), None, torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="even width"):
        compiled.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "start,num_tokens,window",
    [
        (0, 1, None),  # a one-token prompt
        (0, 45, None),  # a fresh prompt: tiles of 16 and a shorter last one
        (37, 12, None),  # a short chunk over cached blocks: tiles smaller than 16 rows
        (37, 12, 6),  # the same under a sliding window
        (21, 70, 9),  # a long chunk whose rows' windows start in different blocks
        (3, 40, 64),  # a window longer than any row's context
    ],
)
@pytest.mark.parametrize(
    "num_heads,kv_heads,head_dim,block_size",
    [
        # Where the vector code runs, a tile's rows of one kv head (positions x the group) are
        # multiplied as one matrix: in vectors of 3, 2 and 1 (48 rows of a group of 3 fill
        # three AVX-512 vectors), with 4 keys at a time and a tail of fewer.
        (6, 2, 64, 4),
        (6, 2, 64, 16),
        (8, 1, 32, 16),  # multi-query: 128 rows a kv head
        (4, 4, 128, 16),  # plain multi-head; head_dim in two 64-float slices
        (2, 1, 96, 8),  # 64 floats of a head, then 16- or 8-float vectors
        (6, 2, 24, 16),  # a multiple of 8, not of 16: AVX2's vectors, AVX-512's portable loops
        (6, 3, 20, 8),  # head_dim not a multiple of 8: the portable path
    ],
)
def test_prefill_kernel_attends_a_chunk_in_place_as_sdpa_over_its_blocks(
    compiled, start, num_tokens, window, kv_dtype, num_heads, kv_heads, head_dim, block_size
):
    from runtime.engine.model import AttentionMetadata, PagedPrefill, PrefillAttention
    from runtime.engine.model import paged_attention as attend

    end = start + num_tokens
    q, k_cache, v_cache, tables, _ = random_case(
        rows=1, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, lens=[end])
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    key_positions = torch.arange(tables.shape[1] * block_size).unsqueeze(0)
    query_positions = torch.arange(start, end).unsqueeze(1)
    mask = key_positions <= query_positions
    if window is not None:
        mask &= key_positions > query_positions - window
    unused = torch.empty(0)

    def run(chunk: PrefillAttention) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=unused, prefills=[chunk])
        return attend(q, unused, unused, k_cache, v_cache, meta)

    gathered = run(PrefillAttention(0, num_tokens, context_blocks=tables[0].long(), mask=mask))
    # Slots past the chunk's last position hold whatever the cache held: never to be read.
    for position in range(end, tables.shape[1] * block_size):
        block = tables[0, position // block_size]
        k_cache[block, position % block_size] = float("nan")
        v_cache[block, position % block_size] = float("nan")
    in_place = run(PrefillAttention(0, num_tokens, None, None, paged=PagedPrefill(
        compiled.paged_prefill_attention, tables[0].contiguous(), start, window)))
    torch.testing.assert_close(in_place, gathered, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_refuses_what_it_would_read_out_of_bounds(compiled):
    q, k_cache, v_cache, tables, _ = random_case(
        rows=1, num_heads=4, kv_heads=2, head_dim=64, block_size=16, lens=[33])
    rows = torch.randn(10, 4, 64)
    out = torch.empty_like(rows)
    with pytest.raises(ValueError, match="longer than its block table"):
        compiled.paged_prefill_attention(rows, k_cache, v_cache, tables[0][:2].contiguous(), 30,
                                         out)  # positions 30..39 need 3 blocks
    bad = tables[0].clone()
    bad[1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        compiled.paged_prefill_attention(rows, k_cache, v_cache, bad, 20, out)
    with pytest.raises(ValueError, match="one contiguous row of int32"):
        compiled.paged_prefill_attention(rows, k_cache, v_cache, tables, 20, out)


def test_the_runner_attends_prefill_chunks_in_place_with_the_kernels_and_by_sdpa_without(
    make_engine, native
):
    from dataclasses import replace

    from runtime.engine.scheduler import ScheduledChunk
    from runtime.engine.sequence import Sequence

    seq = Sequence("r", list(range(3, 203)))
    seq.block_table = list(range(50))
    runner = make_engine(ops_backend="kernels").runner
    assert runner.plan.prefill_attention == "kernel"
    with_context = runner._prefill_metadata(ScheduledChunk(seq, 100, 40, completes_sequence=False), 0)
    fresh = runner._prefill_metadata(ScheduledChunk(seq, 0, 16, completes_sequence=False), 0)
    assert with_context.paged is not None and with_context.paged.start == 100
    # 4-token blocks: positions up to 139 span 35 of them, a fresh 16-token prompt 4.
    assert with_context.paged.block_table.tolist() == list(range(35))
    assert fresh.paged is not None and fresh.paged.block_table.tolist() == [0, 1, 2, 3]
    # bf16 prefill attention (a bf16 cache on AMX) stays with SDPA, as does the torch path.
    runner.plan = replace(runner.plan, prefill_attention="sdpa",
                          prefill_attention_dtype=torch.bfloat16)
    gathered = runner._prefill_metadata(ScheduledChunk(seq, 100, 40, completes_sequence=False), 0)
    assert gathered.paged is None and gathered.context_blocks is not None
    torch_runner = make_engine(ops_backend="torch").runner
    fresh = torch_runner._prefill_metadata(ScheduledChunk(seq, 0, 16, completes_sequence=False), 0)
    assert fresh.paged is None and fresh.context_blocks is None
