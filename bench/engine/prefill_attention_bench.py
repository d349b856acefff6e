"""Prefill attention over a bf16 KV cache: attended in float32 or in bf16, on this CPU.

A bf16 model keeps float32 activations around its bf16 matmuls, and its KV cache is bf16
(plan.ExecutionPlan). A prefill chunk's attention can then run in
float32 (the bf16 keys and values widened) or in bf16 (the queries rounded);
`plan.prefill_attention_dtype` picks bf16 only where the CPU has AMX, because that
is where torch's flash attention was measured faster in bf16. This times the engine's own
`model.paged_attention` for both choices on the same chunks, alternating, so that rule can be
re-checked on any CPU: whole prompts of 256, 512 and 1,024 tokens (causal) and chunks over
cached blocks (masked), with the heads of `--model`'s config.json (default: small's, 12 query
heads over 4 KV heads of 64). Medians in ms per chunk go to --result-json, with the CPU's
flags and the dtype the engine picks here.

    .venv/bin/python bench/engine/prefill_attention_bench.py \\
        --result-json bench/engine/results/prefill_attention_round15.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from serving_bench import emit_report  # noqa: E402

from runtime.engine import plan  # noqa: E402
from runtime.engine.config import ModelConfig  # noqa: E402
from runtime.engine.demo_model import PRESETS  # noqa: E402
from runtime.engine.model import AttentionMetadata, PrefillAttention, paged_attention  # noqa: E402

# (new tokens, tokens already cached): B's prompts are 32-512 tokens, its chunks up to 2,048,
# and a prefix hit or a later chunk of a long prompt attends over cached blocks.
CHUNKS = ((256, 0), (512, 0), (1024, 0), (512, 256), (200, 600))


def chunk_inputs(heads: int, kv_heads: int, head_dim: int, new: int, cached: int,
                 block_size: int = 16) -> tuple:
    """q, k, v of one chunk and a bf16 cache with blocks for its context and itself, shaped as
    the model runner builds them (random values: only the time counts here)."""
    generator = torch.Generator().manual_seed(new * 7 + cached)
    total = cached + new
    num_blocks = -(-total // block_size)
    q = torch.randn(new, heads, head_dim, generator=generator)
    k = torch.randn(new, kv_heads, head_dim, generator=generator)
    v = torch.randn(new, kv_heads, head_dim, generator=generator)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).bfloat16()
    v_cache = torch.randn(shape, generator=generator).bfloat16()
    if cached:
        blocks = torch.arange(num_blocks)
        mask = torch.arange(total).unsqueeze(0) <= torch.arange(cached, total).unsqueeze(1)
        chunk = PrefillAttention(0, new, blocks, mask)
    else:
        chunk = PrefillAttention(0, new, None, None)
    return q, k, v, k_cache, v_cache, chunk


def time_chunk(inputs: tuple, prefill_dtype: torch.dtype, reps: int) -> list[float]:
    q, k, v, k_cache, v_cache, chunk = inputs
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=[chunk],
                             prefill_dtype=prefill_dtype)
    times = []
    with torch.inference_mode():
        paged_attention(q, k, v, k_cache, v_cache, meta)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            paged_attention(q, k, v, k_cache, v_cache, meta)
            times.append(time.perf_counter() - start)
    return times


def heads_of(model_dir: Path | None) -> tuple[int, int, int]:
    if model_dir is not None:
        config = ModelConfig.from_dir(model_dir)
        return config.num_heads, config.num_kv_heads, config.head_dim
    small = PRESETS["small"]
    return (small.num_attention_heads, small.num_key_value_heads,
            small.hidden_size // small.num_attention_heads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint whose heads to use (default: the small preset's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10, help="timed calls per dtype and round")
    parser.add_argument("--rounds", type=int, default=3, help="float32 and bf16 alternate")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = heads_of(args.model)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    chunks = {}
    for new, cached in CHUNKS:
        inputs = chunk_inputs(heads, kv_heads, head_dim, new, cached)
        times: dict[str, list[float]] = {name: [] for name in dtypes}
        for _ in range(args.rounds):
            for name, dtype in dtypes.items():
                times[name] += time_chunk(inputs, dtype, args.reps)
        medians = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
        chunks[f"{new}_new_over_{cached}_cached"] = {
            "median_ms": medians,
            "float32_over_bf16": round(medians["float32"] / medians["bfloat16"], 2),
        }
    chosen = plan.prefill_attention_dtype(torch.float32, torch.bfloat16, plan.cpu_has_amx())
    emit_report({
        "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "threads": args.threads,
        "cpu": {"amx": plan.cpu_has_amx(),
                "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
                "capability": torch.backends.cpu.get_cpu_capability()},
        "engine_prefill_dtype_here": str(chosen).removeprefix("torch."),
        "chunks": chunks,
    }, args.result_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
