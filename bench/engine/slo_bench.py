"""Goodput under overload: the engine's `slo` scheduling policy against `fcfs` and vLLM's CPU build.

Workload B (online_bench's mix: prompts of 32-512 tokens, outputs of 16-256, 30 % sharing a
256-token prefix, Poisson arrivals) on the `small` demo model, at multiples of vLLM's saturation
rate and as one burst. vLLM's saturation rate is measured first, in the same run: the requests a
second it completes on a burst of `--burst-prompts` (skipped with `--saturation-rate`). Then, for
each seed, each server in turn (one up at a time, the same KV memory and step limits) runs every
rate multiple with `--num-prompts` requests and the burst; a seed gives every server the same
prompts and arrivals. Goodput counts requests that meet both TTFT <= --slo-ttft-ms and
TPOT <= --slo-tpot-ms, per second of the run; a request refused as late (503 `slo_late`) is
neither served nor good.

Servers: `vllm` (as its CPU guide runs it), `fcfs` (`inferops serve --scheduling-policy fcfs`),
`slo` (`--scheduling-policy slo --slo-reject-late`, the bench's SLOs as its targets) and
`slo-serve-late` (`slo` without refusals). `--only-first-seed` names servers and multiples run on
the first seed alone, to keep the run short.

    .venv/bin/python bench/engine/slo_bench.py --result-json bench/engine/results/slo_small.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import engine_runs as shared
from online_bench import workload_b
from serving_bench import VLLM_PYTHON, add_dtype_argument, add_vllm_preload_argument, vllm_ld_preload

from runtime.loadgen import run_benchmark

BURST = "burst"
# The goals, per rate multiple (bench/README.md says which were met).
GOODPUT_OVER_VLLM = 1.5
GOODPUT_OVER_SATURATION = 0.5
SERVED_GOOD_SHARE = 0.8
BURST_GOODPUT_OVER_SATURATION = 0.25
# Replica counters read before and after each run (inferops only).
COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "inferops:slo_rejected_late_total", "inferops:slo_served_late_total",
            "inferops:slo_requests_judged_total", "inferops:slo_deadline_misses_total")


def server_specs(model_dir: Path, args: argparse.Namespace) -> dict[str, shared.ServerSpec]:
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    kv = ["--kv-cache-memory", f"{args.kv_cache_gib}GiB"]
    targets = ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]
    vllm = shared.vllm_spec(model_dir, args.port, args.threads, args.dtype, args.vllm_preload)

    def ours(name: str, *flags: str) -> shared.ServerSpec:
        spec = shared.inferops_spec(model_dir, args.port, args.threads, [*kv, *limits, *targets, *flags], args.dtype)
        return shared.ServerSpec(name, spec.command, spec.env)

    return {
        "vllm": shared.ServerSpec("vllm", [*vllm.command, *limits],
                                  {**vllm.env, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}),
        "fcfs": ours("fcfs", "--scheduling-policy", "fcfs"),
        "slo": ours("slo", "--scheduling-policy", "slo", "--slo-reject-late"),
        "slo-serve-late": ours("slo-serve-late", "--scheduling-policy", "slo"),
    }


def counters(base_url: str) -> dict[str, float]:
    return {name: shared.metric_total(base_url, name) for name in COUNTERS}


def one_run(session: shared.ServerSession, args: argparse.Namespace, rate: float, num_prompts: int,
            seed_offset: int, is_vllm: bool) -> dict:
    config = workload_b(session.base_url, session.model_dir, args, rate, seed_offset)
    config.num_prompts = num_prompts
    before = {} if is_vllm else counters(session.base_url)
    with shared.MachineLoad() as machine:
        metrics = run_benchmark(config)
    result = {key: metrics[key] for key in shared.REPORTED}
    result["rate"] = rate
    result["rejected"] = int((metrics.get("errors") or {}).get("http_503", 0))
    served = result["completed"]
    good = (metrics["request_goodput"] or 0) * metrics["duration"]
    result["good"] = round(good)
    result["served_good_share"] = round(good / served, 4) if served else None
    if not is_vllm:
        after = counters(session.base_url)
        result["replica_counters"] = {name.removesuffix("_total"): after[name] - before[name] for name in COUNTERS}
    result.update(machine.fields())
    return result


def run_server(name: str, spec: shared.ServerSpec, model_dir: Path, args: argparse.Namespace, seed_index: int,
               saturation: float, multiples: list[str]) -> dict:
    runs = {}
    with shared.ServerSession(spec, f"slo_{name}", model_dir, args) as session:
        for offset, multiple in enumerate(multiples):
            # The same prompts for every server at a (seed, multiple); fresh ones per multiple.
            seed_offset = 1000 * args.seeds[seed_index] + offset
            if multiple == BURST:
                rate, count = math.inf, args.burst_prompts
            else:
                rate, count = float(multiple) * saturation, args.num_prompts
            print(f"{name} seed {args.seeds[seed_index]}: {multiple} at {rate:.3f} req/s ...", file=sys.stderr)
            runs[multiple] = one_run(session, args, rate, count, seed_offset, name == "vllm")
    return runs


def measure_saturation(specs: dict, model_dir: Path, args: argparse.Namespace) -> dict:
    if args.saturation_rate:
        return {"rate": args.saturation_rate, "source": "given (--saturation-rate)"}
    name = "vllm" if "vllm" in specs and VLLM_PYTHON.is_file() else "fcfs"
    with shared.ServerSession(specs[name], f"slo_{name}_saturation", model_dir, args) as session:
        run = one_run(session, args, math.inf, args.burst_prompts, 999_999, name == "vllm")
    return {"rate": round(run["request_throughput"], 4), "source": f"{name}, a burst of {args.burst_prompts}",
            "run": run}


def summarise(results: dict, saturation: float, multiples: list[str]) -> dict:
    """Medians over seeds per server and multiple, ratios, and the issue's goals met or not."""
    summary: dict = {}
    for multiple in multiples:
        row: dict = {}
        for name, by_seed in results.items():
            runs = [seed_runs[multiple] for seed_runs in by_seed.values() if multiple in seed_runs]
            if not runs:
                continue
            row[name] = {key: statistics.median(r[key] for r in runs if r[key] is not None)
                         for key in ("request_goodput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
                                     "median_tpot_ms", "p99_tpot_ms", "rejected", "served_good_share")
                         if any(r[key] is not None for r in runs)}
            row[name]["seeds"] = len(runs)
        slo, vllm, fcfs = row.get("slo"), row.get("vllm"), row.get("fcfs")
        goals: dict = {}
        if slo and vllm and vllm["request_goodput"]:
            row["slo_over_vllm_goodput"] = round(slo["request_goodput"] / vllm["request_goodput"], 2)
        if slo and fcfs and fcfs["request_goodput"]:
            row["slo_over_fcfs_goodput"] = round(slo["request_goodput"] / fcfs["request_goodput"], 2)
        if slo and multiple in ("1.5", "2.0", "2"):
            if vllm:
                goals[f"goodput >= {GOODPUT_OVER_VLLM}x vLLM's"] = \
                    slo["request_goodput"] >= GOODPUT_OVER_VLLM * vllm["request_goodput"]
            goals[f"goodput >= {GOODPUT_OVER_SATURATION}x vLLM's saturation rate"] = \
                slo["request_goodput"] >= GOODPUT_OVER_SATURATION * saturation
            goals[f">= {SERVED_GOOD_SHARE:.0%} of served meet both"] = \
                (slo.get("served_good_share") or 0) >= SERVED_GOOD_SHARE
        if slo and multiple == BURST:
            goals[f"goodput >= {BURST_GOODPUT_OVER_SATURATION}x vLLM's saturation rate"] = \
                slo["request_goodput"] >= BURST_GOODPUT_OVER_SATURATION * saturation
        if slo and fcfs and multiple == "0.7":
            goals["goodput no worse than fcfs"] = slo["request_goodput"] >= fcfs["request_goodput"]
        if goals:
            row["goals"] = goals
        summary[multiple] = row
    return summary


def plan(args: argparse.Namespace) -> list[tuple[int, str, list[str]]]:
    """(seed index, server, multiples) in run order: servers alternate within each seed."""
    only_first = {name.strip() for name in args.only_first_seed.split(",") if name.strip()}
    steps = []
    for index in range(len(args.seeds)):
        for name in args.servers.split(","):
            multiples = [m for m in args.multiples if index == 0 or (m not in only_first and name not in only_first)]
            if multiples:
                steps.append((index, name, multiples))
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8035, seed=False)
    parser.set_defaults(model=Path("bench/engine/work/small"), startup_timeout=600.0)
    parser.add_argument("--servers", default="vllm,fcfs,slo", help="of vllm, fcfs, slo, slo-serve-late")
    parser.add_argument("--seeds", type=lambda t: [int(s) for s in t.split(",")], default=[0, 1, 2])
    parser.add_argument("--multiples", type=lambda t: [s.strip() for s in t.split(",")],
                        default=["0.7", "1.0", "1.5", "2.0", BURST],
                        help="of vLLM's saturation rate, and `burst` (all requests at once)")
    parser.add_argument("--only-first-seed", default="",
                        help="servers or multiples run on the first seed only, e.g. `fcfs,0.7`")
    parser.add_argument("--saturation-rate", type=float, default=None,
                        help="req/s to take as vLLM's saturation rate instead of measuring it")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests at each rate")
    parser.add_argument("--burst-prompts", type=int, default=100)
    parser.add_argument("--input-len", default="32-512")
    parser.add_argument("--output-len", default="16-256")
    parser.add_argument("--shared-prefix-len", type=int, default=256)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.3)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands, start nothing")
    add_dtype_argument(parser)
    add_vllm_preload_argument(parser)
    args = parser.parse_args(argv)
    args.seed = 0  # workload_b's base seed: each run's offset holds its seed (one_run)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = server_specs(Path(args.model), args)
    unknown = set(args.servers.split(",")) - set(specs)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}; choose from {sorted(specs)}")
    if args.dry_run:
        for index, name, multiples in plan(args):
            print(f"seed {args.seeds[index]}: {name} at {', '.join(multiples)}: {' '.join(specs[name].command)}")
        return 0
    model_dir = shared.benchmark_model(args.model)
    specs = server_specs(model_dir, args)
    saturation = measure_saturation(specs, model_dir, args)
    results: dict = {name: {} for name in args.servers.split(",")}

    def report() -> dict:
        ran = {name: by_seed for name, by_seed in results.items() if by_seed and "skipped" not in by_seed}
        return {**shared.workload_report(args, model_dir), "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
                "saturation": saturation, "summary": summarise(ran, saturation["rate"], args.multiples),
                "servers": results}

    for index, name, multiples in plan(args):
        if name == "vllm" and not VLLM_PYTHON.is_file():
            results[name] = {"skipped": f"{VLLM_PYTHON} missing; run bench/engine/peers.sh"}
            continue
        results[name][str(args.seeds[index])] = run_server(name, specs[name], model_dir, args, index,
                                                           saturation["rate"], multiples)
        if args.result_json:  # what ran so far survives a run cut short
            args.result_json.write_text(json.dumps(report(), indent=2) + "\n")
    shared.emit_report(report(), args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
