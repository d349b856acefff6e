"""Memory: 256 concurrent requests against a KV pool far too small for them, and a 4x larger pool.

`inferops serve --num-kv-blocks N` is started with N blocks (by default enough for about 16 of
the sequences at their full length) and then with 4 N, and each time sent the same 256 seeded
requests all at once. The report holds, per run: completions and errors, the replica's
`vllm:num_preemptions_total` over the run, the server process's peak resident memory (VmRSS
sampled every 100 ms) and the KV pool's size in bytes.

    .venv/bin/python bench/engine/memory_bench.py --result-json bench/engine/results/memory.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import engine_runs as shared
import torch

from runtime.engine.config import ModelConfig
from runtime.engine.model_runner import kv_bytes_per_block
from runtime.loadgen import BenchConfig, LengthRange, run_benchmark

MIB = 1024 * 1024


def blocks_for_sequences(num_sequences: int, args: argparse.Namespace) -> int:
    # +1 for the BOS token the tokenizer puts before each prompt.
    tokens = args.input_len + 1 + args.output_len
    return num_sequences * -(-tokens // args.block_size)


def burst_workload(base_url: str, model_dir: Path, args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        model=shared.SERVED_NAME,
        num_prompts=args.num_prompts,
        input_len=LengthRange(args.input_len, args.input_len),
        output_len=LengthRange(args.output_len, args.output_len),
        tokenizer_dir=str(model_dir),
        seed=args.seed,
        show_progress=False,
    )


def run_once(num_blocks: int, model_dir: Path, args: argparse.Namespace) -> dict:
    extra = ["--num-kv-blocks", str(num_blocks), "--block-size", str(args.block_size)]
    spec = shared.inferops_spec(model_dir, args.port, args.threads, extra)
    per_block = kv_bytes_per_block(ModelConfig.from_dir(model_dir), args.block_size, torch.float32)
    try:
        with shared.ServerSession(spec, f"memory_{num_blocks}", model_dir, args, warm=False) as session:
            base_url, pid = session.base_url, session.server.process.pid
            rss_ready = shared.rss_bytes(pid) or 0
            preemptions_before = shared.metric_total(base_url, "vllm:num_preemptions_total")
            print(f"benchmarking {num_blocks} KV blocks ...", file=sys.stderr)
            with shared.MachineLoad() as machine, shared.RssSampler(pid) as rss:
                metrics = run_benchmark(burst_workload(base_url, model_dir, args))
            preemptions = shared.metric_total(base_url, "vllm:num_preemptions_total") - preemptions_before
    except RuntimeError as error:
        return {"skipped": str(error)}
    result = {key: metrics[key] for key in shared.REPORTED}
    result.update(
        num_kv_blocks=num_blocks,
        kv_pool_bytes=num_blocks * per_block,
        kv_pool_mib=round(num_blocks * per_block / MIB, 2),
        preemptions=preemptions,
        rss_ready_mib=round(rss_ready / MIB, 1),
        rss_peak_mib=round(rss.peak / MIB, 1),
        rss_samples=len(rss.samples),
        **machine.fields(),
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8033)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--fits-sequences", type=int, default=16,
                        help="size the small pool for this many full-length sequences")
    parser.add_argument("--larger-factor", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = shared.benchmark_model(args.model)
    small = blocks_for_sequences(args.fits_sequences, args)
    runs = {}
    # Alternating rounds, so that other work on a shared machine shows up as spread, not as a
    # difference between the pools.
    for round_number in range(1, args.rounds + 1):
        runs[f"small_pool_{round_number}"] = run_once(small, model_dir, args)
        runs[f"larger_pool_{round_number}"] = run_once(small * args.larger_factor, model_dir, args)
    shared.emit_report({**shared.workload_report(args, model_dir), "runs": runs}, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
