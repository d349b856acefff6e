"""Prefix cache: TTFT of requests sharing a system prefix, cache on against `--no-prefix-caching`.

`inferops serve` is started twice on the tiny demo checkpoint, once as is and once with
`--no-prefix-caching`, and each time sent the same seeded requests: all share a 256-token prefix
and differ in a short suffix, at a modest Poisson rate so TTFT measures prefill rather than
queueing. The report holds both runs' metrics, the TTFT p50 ratio (target <= 0.5), each
replica's `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run, and its
own mean TTFT and queue time (from its histograms), which split the client's TTFT into HTTP,
waiting for the step in flight, and the step.

    .venv/bin/python bench/engine/prefix_bench.py --result-json bench/engine/results/prefix.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import engine_runs as shared
from serving_bench import add_dtype_argument

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark

TTFT_RATIO_TARGET = 0.5
SERVER_COUNTERS = (
    "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:request_queue_time_seconds_sum",
)


def shared_prefix_workload(base_url: str, model_dir: Path, args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        model=shared.SERVED_NAME,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        input_len=LengthRange(args.suffix_len, args.suffix_len),
        output_len=LengthRange(args.output_len, args.output_len),
        shared_prefix_len=args.prefix_len,
        shared_prefix_ratio=1.0,
        tokenizer_dir=str(model_dir),
        seed=args.seed,
        show_progress=False,
    )



def run_once(label: str, extra: list[str], model_dir: Path, args: argparse.Namespace) -> dict:
    spec = shared.inferops_spec(model_dir, args.port, args.threads, extra, args.dtype)
    try:
        with shared.ServerSession(spec, f"prefix_{label}", model_dir, args) as session:
            base_url = session.base_url
            before = {name: shared.metric_total(base_url, name) for name in SERVER_COUNTERS}
            print(f"benchmarking prefix cache {label} ...", file=sys.stderr)
            with shared.MachineLoad() as machine:
                metrics = run_benchmark(shared_prefix_workload(base_url, model_dir, args))
            counted = {name: shared.metric_total(base_url, name) - before[name] for name in SERVER_COUNTERS}
    except RuntimeError as error:
        return {"skipped": str(error)}
    result = {key: metrics[key] for key in shared.REPORTED}
    hits = counted["vllm:prefix_cache_hits_total"]
    queries = counted["vllm:prefix_cache_queries_total"]
    requests = counted["vllm:time_to_first_token_seconds_count"]
    result.update(
        mean_ttft_ms=metrics["mean_ttft_ms"],  # beside the server's mean below
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        prefix_cache_hit_rate=round(hits / queries, 4) if queries else None,
        # The replica's own view: arrival in the handler to the first token, and to the start
        # of the step that produced it; the client's TTFT minus the first is HTTP both ways.
        server_mean_ttft_ms=round(
            counted["vllm:time_to_first_token_seconds_sum"] / requests * 1000, 2)
        if requests else None,
        server_mean_queue_ms=round(
            counted["vllm:request_queue_time_seconds_sum"] / requests * 1000, 2)
        if requests else None,
        **machine.fields(),
    )
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8032)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=2.0)
    add_dtype_argument(parser)
    parser.add_argument("--cache-off-first", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = shared.benchmark_model(args.model)
    flags = {"cache_on": ("on", []), "cache_off": ("off", ["--no-prefix-caching"])}
    # Alternating rounds (and an option for the order), so that a drift in the machine's load
    # shows up as spread between rounds rather than as a difference between the settings.
    order = ["cache_off", "cache_on"] if args.cache_off_first else ["cache_on", "cache_off"]
    runs = {
        f"{name}_{round_number}": run_once(*flags[name], model_dir, args)
        for round_number in range(1, args.rounds + 1)
        for name in order
    }
    report = {**shared.workload_report(args, model_dir), "runs": runs}
    ratios = [
        runs[f"cache_on_{n}"]["median_ttft_ms"] / runs[f"cache_off_{n}"]["median_ttft_ms"]
        for n in range(1, args.rounds + 1)
        if runs[f"cache_on_{n}"].get("median_ttft_ms") and runs[f"cache_off_{n}"].get("median_ttft_ms")
    ]
    if ratios:
        report["ttft_p50_on_over_off_per_round"] = [round(ratio, 3) for ratio in ratios]
        report["target_met"] = max(ratios) <= TTFT_RATIO_TARGET
    shared.emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
