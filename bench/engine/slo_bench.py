"""Goodput under overload: the engine's `slo` scheduling policy against `fcfs` and vLLM's CPU build.

Workload B (online_bench's mix: prompts of 32-512 tokens, outputs of 16-256, 30 % sharing a
256-token prefix, Poisson arrivals) on the `small` demo model, at multiples of vLLM's saturation
rate and as one burst. vLLM's saturation rate is measured first, in the same run: the requests a
second it completes on a burst of `--burst-prompts` (skipped with `--saturation-rate`). Then, for
each seed, each server in turn (one up at a time, the same KV memory and step limits) runs every
rate multiple with `--num-prompts` requests and the burst; a seed gives every server the same
prompts and arrivals. Goodput counts requests that meet both TTFT <= --slo-ttft-ms and
TPOT <= --slo-tpot-ms, per second of the run (runtime.loadgen's one definition: a one-token answer
has no TPOT and counts as meeting it); a request refused as late (503 `slo_late`) is counted as
`rejected`, neither served, failed nor good.

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
import re
import statistics
import sys
from pathlib import Path

import engine_runs as shared
import httpx
from online_bench import workload_b
from serving_bench import VLLM_PYTHON, add_dtype_argument, add_vllm_preload_argument, vllm_ld_preload

from runtime.loadgen import run_benchmark

BURST = "burst"
# The goals, per rate multiple (bench/README.md says which were met).
GOODPUT_OVER_VLLM = 1.5
GOODPUT_OVER_SATURATION = 0.5
SERVED_GOOD_SHARE = 0.8
BURST_GOODPUT_OVER_SATURATION = 0.25
# Each run's figures whose median over seeds the summary gives, per server and multiple.
SUMMARISED = ("request_goodput", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
              "median_tpot_ms", "p99_tpot_ms", "completed", "failed", "rejected", "served_good_share")
# Replica counters read before and after each run, as (series, labels it must have); a series the
# server does not export (vLLM has no inferops:*) is left out of the run's deltas.
COUNTERS = {
    "preemptions": ("vllm:num_preemptions_total", {}),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", {}),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", {}),
    "slo_judged": ("inferops:slo_requests_judged_total", {}),
    "slo_ttft_misses": ("inferops:slo_deadline_misses_total", {"phase": "ttft"}),
    "slo_tpot_misses": ("inferops:slo_deadline_misses_total", {"phase": "tpot"}),
    "slo_rejected_late": ("inferops:slo_rejected_late_total", {}),
    "slo_served_late": ("inferops:slo_served_late_total", {}),
    # The slack histogram has negative edges, so no _count: the +Inf bucket counts admissions and
    # the le="0" bucket those already late when first scheduled.
    "slo_admitted": ("inferops:slo_admission_slack_seconds_bucket", {"le": math.inf}),
    "slo_admitted_late": ("inferops:slo_admission_slack_seconds_bucket", {"le": 0.0}),
}
SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$', re.MULTILINE)
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


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


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(series, labels, value) of each sample in a Prometheus text exposition."""
    return [(name, dict(LABEL.findall(labels or "")), float(value)) for name, labels, value in SAMPLE.findall(text)]


def label_matches(labels: dict[str, str], wanted: dict) -> bool:
    # `le` compares as a number: the engine writes "0", prometheus_client would write "0.0".
    return all(key in labels and (float(labels[key]) == value if key == "le" else labels[key] == value)
               for key, value in wanted.items())


def counters(text: str) -> dict[str, float]:
    """COUNTERS' sums over the samples that match (all engines, models); absent series left out."""
    found: dict[str, float] = {}
    parsed = samples(text)
    for key, (series, wanted) in COUNTERS.items():
        values = [value for name, labels, value in parsed if name == series and label_matches(labels, wanted)]
        if values:
            found[key] = sum(values)
    return found


def replica_settings(text: str) -> dict:
    """The policy and replica-wide targets the replica reports (built-in engine only)."""
    settings: dict = {}
    for name, labels, value in samples(text):
        if name == "inferops:scheduling_policy_info" and value == 1:
            settings["policy"] = labels.get("policy")
        elif name in ("inferops:slo_target_ttft_seconds", "inferops:slo_target_tpot_seconds"):
            settings[name.removeprefix("inferops:")] = value
    return settings


def scrape(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=10).text


def run_record(metrics: dict, rate: float, before: dict[str, float], after: dict[str, float]) -> dict:
    """One run's figures from loadgen's metrics and the replica counters around it."""
    result = {key: metrics[key] for key in shared.REPORTED}
    result["rate"] = rate if math.isfinite(rate) else "inf"
    result["rejected"] = metrics["rejected"]
    result["good"] = metrics["good_requests"]
    served = metrics["completed"]
    result["served_good_share"] = round(metrics["good_requests"] / served, 4) if served else None
    result["replica_counters"] = {key: after[key] - before[key] for key in after if key in before}
    return result


def one_run(session: shared.ServerSession, args: argparse.Namespace, rate: float, num_prompts: int,
            seed_offset: int) -> dict:
    config = workload_b(session.base_url, session.model_dir, args, rate, seed_offset)
    config.num_prompts = num_prompts
    before = counters(scrape(session.base_url))
    with shared.MachineLoad() as machine:
        metrics = run_benchmark(config)
    result = run_record(metrics, rate, before, counters(scrape(session.base_url)))
    result.update(machine.fields())
    return result


def run_server(name: str, spec: shared.ServerSpec, model_dir: Path, args: argparse.Namespace, seed_index: int,
               saturation: float, multiples: list[str], settings: dict) -> dict:
    """Every multiple on one server start; `settings` gets the policy and targets it reports."""
    runs = {}
    with shared.ServerSession(spec, f"slo_{name}", model_dir, args) as session:
        settings.update(replica_settings(scrape(session.base_url)))
        for offset, multiple in enumerate(multiples):
            # The same prompts for every server at a (seed, multiple); fresh ones per multiple.
            seed_offset = 1000 * args.seeds[seed_index] + offset
            if multiple == BURST:
                rate, count = math.inf, args.burst_prompts
            else:
                rate, count = float(multiple) * saturation, args.num_prompts
            print(f"{name} seed {args.seeds[seed_index]}: {multiple} at {rate:.3f} req/s ...", file=sys.stderr)
            runs[multiple] = one_run(session, args, rate, count, seed_offset)
    return runs


def measure_saturation(specs: dict, model_dir: Path, args: argparse.Namespace) -> dict:
    if args.saturation_rate:
        return {"rate": args.saturation_rate, "source": "given (--saturation-rate)"}
    why_not_vllm = None if VLLM_PYTHON.is_file() else f"{VLLM_PYTHON} missing"
    for name in ("vllm", "fcfs"):
        if name == "vllm" and why_not_vllm:
            continue
        try:
            with shared.ServerSession(specs[name], f"slo_{name}_saturation", model_dir, args) as session:
                run = one_run(session, args, math.inf, args.burst_prompts, 999_999)
        except RuntimeError as error:  # vLLM did not come up: the engine's fcfs stands in, said so
            if name != "vllm":
                raise
            why_not_vllm = str(error)
            continue
        source = f"{name}, a burst of {args.burst_prompts}"
        if why_not_vllm:
            source += f" (not vLLM: {why_not_vllm})"
        return {"rate": round(run["request_throughput"], 4), "source": source, "run": run}
    raise AssertionError("unreachable: fcfs either measured or raised")


def multiple_is(multiple: str, *values: float) -> bool:
    """`2`, `2.0` and `2.00` are the same multiple of the saturation rate."""
    return multiple != BURST and any(math.isclose(float(multiple), value) for value in values)


def summarise(results: dict, saturation: float, multiples: list[str]) -> dict:
    """Medians over seeds per server and multiple, ratios, and the issue's goals met or not."""
    summary: dict = {}
    for multiple in multiples:
        row: dict = {}
        for name, by_seed in results.items():
            runs = [seed_runs[multiple] for seed_runs in by_seed.values() if multiple in seed_runs]
            if not runs:
                continue
            row[name] = {key: statistics.median(r[key] for r in runs if r.get(key) is not None)
                         for key in SUMMARISED if any(r.get(key) is not None for r in runs)}
            row[name]["seeds"] = len(runs)
        slo, vllm, fcfs = row.get("slo"), row.get("vllm"), row.get("fcfs")
        goals: dict = {}
        if slo and vllm and vllm["request_goodput"]:
            row["slo_over_vllm_goodput"] = round(slo["request_goodput"] / vllm["request_goodput"], 2)
        if slo and fcfs and fcfs["request_goodput"]:
            row["slo_over_fcfs_goodput"] = round(slo["request_goodput"] / fcfs["request_goodput"], 2)
        if slo and multiple_is(multiple, 1.5, 2.0):
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
        if slo and fcfs and multiple_is(multiple, 0.7):
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


def dry_run_plan(args: argparse.Namespace, specs: dict[str, shared.ServerSpec]) -> str:
    """What a run would do, in order, with the commands it would start."""
    if args.saturation_rate:
        saturation = args.saturation_rate
        lines = [f"saturation: {saturation:g} req/s, given"]
    else:
        saturation = None
        probe = "vllm" if VLLM_PYTHON.is_file() else f"fcfs ({VLLM_PYTHON} missing)"
        lines = [f"saturation: measured first, completed req/s of a burst of {args.burst_prompts} on {probe}"]
    for index, name, multiples in plan(args):
        rates = ", ".join(
            f"{BURST} ({args.burst_prompts} at once)" if m == BURST
            else f"{m}x ({float(m) * saturation:.3f} req/s)" if saturation else f"{m}x"
            for m in multiples)
        lines.append(f"seed {args.seeds[index]}: {name}, {args.num_prompts} requests at {rates}: "
                     f"{' '.join(specs[name].command)}")
    return "\n".join(lines)


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
        print(dry_run_plan(args, specs))
        return 0
    model_dir = shared.benchmark_model(args.model)
    specs = server_specs(model_dir, args)
    saturation = measure_saturation(specs, model_dir, args)
    results: dict = {name: {} for name in args.servers.split(",")}
    settings: dict = {name: {} for name in results}

    def report() -> dict:
        ran = {name: by_seed for name, by_seed in results.items() if by_seed and "skipped" not in by_seed}
        return {**shared.workload_report(args, model_dir), "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
                "saturation": saturation, "summary": summarise(ran, saturation["rate"], args.multiples),
                "replica_settings": settings, "servers": results}

    for index, name, multiples in plan(args):
        if "skipped" in results[name]:
            continue
        if name == "vllm" and not VLLM_PYTHON.is_file():
            results[name] = {"skipped": f"{VLLM_PYTHON} missing; run bench/engine/peers.sh"}
            continue
        try:
            results[name][str(args.seeds[index])] = run_server(name, specs[name], model_dir, args, index,
                                                               saturation["rate"], multiples, settings[name])
        except RuntimeError as error:  # vLLM not coming up is recorded, as online_bench does; ours is a bug
            if name != "vllm":
                raise
            results[name] = {"skipped": f"vLLM did not come up: {error}"}
        if args.result_json:  # what ran so far survives a run cut short
            args.result_json.write_text(json.dumps(report(), indent=2) + "\n")
    shared.emit_report(report(), args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
