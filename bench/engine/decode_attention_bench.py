"""Attention over a paged KV cache: the engine's kernels against vLLM's CPU kernel.

A decode step attends one query row per running sequence over that sequence's cached keys and
values; a prefill attends every position of a prompt over the positions before it. This times
both alone, on the same keys, values and queries for each side:

- the engine's `CpuKernels.paged_attention` (decode) and `paged_prefill_attention` (prefill;
  runtime/engine/csrc/paged_attention.c) with its default 16-token blocks, and with
  `--baseline REV` the kernels as they were at a git revision (built from that revision's
  csrc/ with the same flags; one decode row per position where it had no prefill kernel),
  alternating with the current ones in the same process: an A/B of a kernel change;
- vLLM's `cpu_attention_with_kv_cache` with its CPU default of 128-token blocks, written by its
  own `cpu_attn_reshape_and_cache`, with the scheduler metadata its attention backend builds,
  in its own virtualenv (`bench/engine/peers.sh`) with the `LD_PRELOAD` its CPU guide asks for
  unless `--vllm-preload none`.

Each case is a model's heads (`tiny`'s 4 query over 2 KV heads of 64, `small`'s 12 over 4), a
cache dtype (float32, bf16) and a workload: a decode step of `--rows` sequences with contexts
drawn from `--context` (default 350-700 tokens: workload B's prompts plus part of their
outputs), or one fresh prompt of each `--prefill` length. Blocks are scattered at random over a
pool twice the size needed, as a cache that has served a while holds them. Medians in ms per
call, with the KV bytes of the contexts per second and the largest difference between the
engine's and vLLM's outputs, go to --result-json.

    .venv/bin/python bench/engine/decode_attention_bench.py --baseline HEAD~1 \\
        --result-json bench/engine/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from sampler_bench import add_timing_arguments, start_timing, time_under_vllm  # noqa: E402
from serving_bench import add_vllm_preload_argument, emit_report, vllm_ld_preload  # noqa: E402

from runtime.engine import kernels  # noqa: E402
from runtime.engine.demo_model import PRESETS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENGINE_BLOCK_SIZE = 16
VLLM_BLOCK_SIZE = 128  # vLLM's CPU platform default (vllm/platforms/cpu.py)

# Runs under vLLM's interpreter after sampler_bench.VLLM_TIMER_PREAMBLE: prints
# {case: [ms, ...]} last and saves each case's output beside its inputs for the comparison.
VLLM_TIMER = """
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

for case in spec["cases"]:
    inputs = torch.load(case["inputs"])
    q, keys, values, lens = inputs["q"], inputs["keys"], inputs["values"], inputs["lens"]
    dtype = getattr(torch, case["dtype"])
    _, heads, head_dim = q.shape
    rows = len(lens)
    kv_heads, block_size = keys.shape[1], case["vllm_block_size"]
    isa = _get_attn_isa(dtype, block_size, head_dim)
    per_row = [-(-int(n) // block_size) for n in lens]
    generator = torch.Generator().manual_seed(case["seed"])
    pool = torch.randperm(2 * sum(per_row), generator=generator).to(torch.int32)
    tables = torch.zeros(rows, max(per_row), dtype=torch.int32)
    slots, used = [], 0
    for r, blocks in enumerate(per_row):
        tables[r, :blocks] = pool[used:used + blocks]
        used += blocks
        positions = torch.arange(int(lens[r]))
        slots.append(tables[r, positions // block_size].long() * block_size + positions % block_size)
    kv_cache = torch.zeros(2 * sum(per_row), kv_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(
        kv_cache.shape[0], kv_heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys.to(dtype), values.to(dtype), key_cache, value_cache,
                                   torch.cat(slots), isa)
    q = q.to(dtype)  # vLLM attends in the model's dtype; the engine keeps float32 queries
    query_start_loc = torch.cat([torch.zeros(1), inputs["new"].cumsum(0)]).to(torch.int32)
    seq_lens = lens.to(torch.int32)
    out = torch.empty_like(q)
    samples = []
    for rep in range(spec["reps"] + 1):
        started = time.perf_counter()
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=rows, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=True)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=head_dim ** -0.5,
            causal=True, alibi_slopes=None, sliding_window=-1, block_table=tables,
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        samples.append((time.perf_counter() - started) * 1000)
    times[case["name"]] = samples[1:]  # the first call warms up
    torch.save(out.float(), case["vllm_result"])
print(json.dumps(times))
"""


def cpu_description() -> dict[str, str]:
    """The CPU's name, family and model (which class of CPU the figures stand for)."""
    wanted = {"model name": "name", "cpu family": "family", "model": "model"}
    found: dict[str, str] = {"capability": torch.backends.cpu.get_cpu_capability()}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted and wanted[key.strip()] not in found:
            found[wanted[key.strip()]] = value.strip()
    return found


def heads_of(preset: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a demo preset."""
    config = PRESETS[preset]
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, config.hidden_size // heads


def make_inputs(heads: int, kv_heads: int, head_dim: int, lens: torch.Tensor, new: torch.Tensor,
                seed: int) -> dict[str, torch.Tensor]:
    """Each sequence's keys and values one after another, and queries for its last `new`
    positions (1 for a decode), all the sequences' queries one after another."""
    generator = torch.Generator().manual_seed(seed)
    total = int(lens.sum())
    return {
        "q": torch.randn(int(new.sum()), heads, head_dim, generator=generator),
        "keys": torch.randn(total, kv_heads, head_dim, generator=generator),
        "values": torch.randn(total, kv_heads, head_dim, generator=generator),
        "lens": lens,
        "new": new,
    }


def workloads(args: argparse.Namespace) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name: (context lengths, query rows per sequence). A decode step of --rows sequences,
    then one fresh prompt of each --prefill length (its causal attention over itself)."""
    generator = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.context[0], args.context[1] + 1, (args.rows,), generator=generator)
    found = {"decode": (lens, torch.ones(args.rows, dtype=torch.long))}
    for length in args.prefill:
        found[f"prefill {length}"] = (torch.tensor([length]), torch.tensor([length]))
    return found


def engine_layout(inputs: dict[str, torch.Tensor], dtype: torch.dtype, seed: int):
    """The engine's caches [blocks, 16, kv_heads, head_dim] with each row's blocks scattered
    over a pool twice the size needed, its block tables and its context lengths."""
    keys, values, lens = inputs["keys"], inputs["values"], inputs["lens"]
    per_row = [-(-int(n) // ENGINE_BLOCK_SIZE) for n in lens]
    pool = torch.randperm(2 * sum(per_row), generator=torch.Generator().manual_seed(seed))
    shape = (2 * sum(per_row), ENGINE_BLOCK_SIZE, *keys.shape[1:])
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    tables = torch.zeros(len(per_row), max(per_row), dtype=torch.int32)
    used = first = 0
    for r, blocks in enumerate(per_row):
        tables[r, :blocks] = pool[used:used + blocks].to(torch.int32)
        used += blocks
        positions = torch.arange(int(lens[r]))
        block_ids = tables[r, positions // ENGINE_BLOCK_SIZE].long()
        k_cache[block_ids, positions % ENGINE_BLOCK_SIZE] = keys[first:first + len(positions)].to(dtype)
        v_cache[block_ids, positions % ENGINE_BLOCK_SIZE] = values[first:first + len(positions)].to(dtype)
        first += len(positions)
    return k_cache, v_cache, tables, lens.to(torch.int32)


def baseline_kernels(revision: str, work_dir: Path) -> kernels.CpuKernels:
    """The kernels as they were at `revision`: its csrc/ built with today's flags."""
    source_dir = work_dir / "baseline_csrc"
    source_dir.mkdir(parents=True, exist_ok=True)
    listing = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "ls-tree", "--name-only", f"{revision}:runtime/engine/csrc"],
        capture_output=True, text=True, check=True).stdout.split()
    for name in listing:
        source = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "show", f"{revision}:runtime/engine/csrc/{name}"],
            capture_output=True, text=True, check=True).stdout
        (source_dir / name).write_text(source)
    library = work_dir / "baseline_kernels.so"
    compiler = kernels.find_compiler()
    subprocess.run([compiler, *kernels.CFLAGS, "-o", str(library),
                    *map(str, sorted(source_dir.glob("*.c"))), *kernels.LIBS], check=True)
    return kernels.CpuKernels(ctypes.CDLL(str(library)))


def time_engine(implementations: dict[str, kernels.CpuKernels], case_inputs, new: torch.Tensor,
                reps: int):
    """{implementation: [ms, ...]}, the implementations alternating call by call, and the
    current kernel's output. A decode step goes to paged_attention, a prefill (one sequence)
    to paged_prefill_attention where the implementation has it, else one decode row per
    position."""
    q, k_cache, v_cache, tables, lens = case_inputs
    outputs = {name: torch.empty_like(q) for name in implementations}
    samples: dict[str, list[float]] = {name: [] for name in implementations}
    prefill_start = int(lens[0] - new[0]) if len(new) == 1 and new[0] > 1 else None

    def attend(implementation: kernels.CpuKernels, out: torch.Tensor) -> None:
        if prefill_start is None:
            implementation.paged_attention(q, k_cache, v_cache, tables, lens, out)
        elif hasattr(implementation, "_paged_prefill_attention_f32"):
            implementation.paged_prefill_attention(q, k_cache, v_cache, tables[0], prefill_start,
                                                   out)
        else:
            rows = len(q)
            implementation.paged_attention(
                q, k_cache, v_cache, tables.expand(rows, -1).contiguous(),
                torch.arange(prefill_start + 1, prefill_start + rows + 1, dtype=torch.int32), out)

    for rep in range(reps + 1):
        for name, implementation in implementations.items():
            started = time.perf_counter()
            attend(implementation, outputs[name])
            if rep:  # the first call warms up
                samples[name].append((time.perf_counter() - started) * 1000)
    return samples, outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=list(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--context", type=int, nargs=2, default=[350, 700], metavar=("MIN", "MAX"))
    parser.add_argument("--prefill", type=int, nargs="*", default=[512, 2048],
                        help="lengths of fresh prompts whose prefill attention is timed too")
    parser.add_argument("--baseline", default=None,
                        help="a git revision whose csrc/ kernels are timed beside the current ones")
    add_timing_arguments(parser, reps=40, work_dir="decode_attention")
    add_vllm_preload_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = start_timing(parse_args(argv), keep_freed_memory=False)
    implementations = {"engine": kernels.cpu_kernels()}
    if args.baseline:
        implementations[f"engine at {args.baseline}"] = baseline_kernels(args.baseline, args.work_dir)
    cases, results = [], {}
    for (preset, dtype_name), (workload, (lens, new)) in itertools.product(
            itertools.product(args.presets, args.dtypes), workloads(args).items()):
        heads, kv_heads, head_dim = heads_of(preset)
        name = f"{preset} {dtype_name} {workload}"
        slug = name.replace(" ", "_")
        inputs = make_inputs(heads, kv_heads, head_dim, lens, new, args.seed)
        print(f"engine: {name} ...", file=sys.stderr)
        samples, outputs = time_engine(
            implementations,
            (inputs["q"], *engine_layout(inputs, DTYPES[dtype_name], args.seed)), new,
            args.reps)
        kv_bytes = int(inputs["lens"].sum()) * kv_heads * head_dim * 2 * DTYPES[dtype_name].itemsize
        results[name] = {
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "kv_bytes": kv_bytes,
            "ms": {impl: statistics.median(ts) for impl, ts in samples.items()},
            "engine_output": outputs["engine"],
        }
        input_path = args.work_dir / f"{slug}_inputs.pt"
        torch.save(inputs, input_path)
        cases.append({"name": name, "dtype": dtype_name, "inputs": str(input_path),
                      "seed": args.seed, "vllm_block_size": VLLM_BLOCK_SIZE,
                      "vllm_result": str(args.work_dir / f"{slug}_vllm.pt")})
    preload = vllm_ld_preload(args.vllm_preload)
    vllm_times = time_under_vllm(VLLM_TIMER, cases, args, preload)
    report_cases = {}
    for case in cases:
        result = results[case["name"]]
        engine_output = result.pop("engine_output")
        if vllm_times is not None:
            result["ms"]["vllm"] = statistics.median(vllm_times[case["name"]])
            # bf16 queries on vLLM's side: its output differs by bf16 rounding there
            result["max_abs_difference_vs_vllm"] = float(
                (torch.load(case["vllm_result"]) - engine_output).abs().max())
        result["kv_gb_per_s"] = {impl: result["kv_bytes"] / ms / 1e6
                                 for impl, ms in result["ms"].items()}
        if "vllm" in result["ms"]:
            result["vllm_ms_over_engine_ms"] = result["ms"]["vllm"] / result["ms"]["engine"]
        report_cases[case["name"]] = result
    emit_report({
        "benchmark": "decode_attention", "rows": args.rows, "context": args.context,
        "prefill": args.prefill,
        "threads": args.threads, "reps": args.reps, "baseline": args.baseline,
        "engine_block_size": ENGINE_BLOCK_SIZE, "vllm_block_size": VLLM_BLOCK_SIZE,
        "vllm_ld_preload": preload, "cpu": cpu_description(), "cases": report_cases,
    }, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
