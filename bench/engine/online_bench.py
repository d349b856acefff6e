"""Workload B (online): Poisson arrivals near saturation against `inferops serve` and vLLM.

200 requests, prompts of 32-512 tokens, outputs of 16-256, 30% of them sharing a 256-token
system prefix, the same seeded prompts, arrival times, rate and goodput SLOs for both servers,
one after the other in the same run. Unless `--request-rate` is given, the rate is found first
with a quick probe: a burst of `--probe-prompts` requests of the same mix against
`inferops serve`, whose completed requests per second is taken as its saturation rate. With
several rates (`--request-rate 4,6,8,10`) each server runs all of them and its goodput is the
best over the sweep: at a rate both keep up with, both goodputs equal the rate, so a goodput
ratio only shows where one server saturates before the other.

    .venv/bin/python bench/engine/online_bench.py --result-json bench/engine/results/online_tiny.json
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import engine_runs as shared
from serving_bench import (
    VLLM_PYTHON,
    add_dtype_argument,
    add_vllm_preload_argument,
    vllm_ld_preload,
)

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark

# With --per-request: what run_benchmark records per request, in arrival order.
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "e2els")

GOODPUT_RATIO_TARGET = 1.5


def workload_b(
    base_url: str, model_dir: Path, args: argparse.Namespace, rate: float, seed_offset: int = 0
) -> BenchConfig:
    return BenchConfig(
        base_url=base_url,
        model=shared.SERVED_NAME,
        num_prompts=args.num_prompts,
        request_rate=rate,
        input_len=LengthRange.parse(args.input_len, "input_len"),
        output_len=LengthRange.parse(args.output_len, "output_len"),
        shared_prefix_len=args.shared_prefix_len,
        shared_prefix_ratio=args.shared_prefix_ratio,
        goodput_slos_ms={"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
        tokenizer_dir=str(model_dir),
        seed=args.seed + seed_offset,
        show_progress=False,
    )



def probe_saturation_rate(session: shared.ServerSession, args: argparse.Namespace) -> dict:
    config = workload_b(session.base_url, session.model_dir, args, math.inf)
    config.num_prompts = args.probe_prompts
    print(f"probing with a burst of {args.probe_prompts} requests ...", file=sys.stderr)
    metrics = run_benchmark(config)
    return {
        "probe_prompts": args.probe_prompts,
        "probe_request_throughput": metrics["request_throughput"],
        "probe_output_throughput": metrics["output_throughput"],
        "probe_load_average_after": shared.load_average(),
    }


def measure(
    session: shared.ServerSession, args: argparse.Namespace, rate: float, name: str, seed_offset: int
) -> dict:
    print(f"benchmarking {name} at {rate:.3f} req/s ...", file=sys.stderr)
    with shared.MachineLoad() as machine:
        metrics = run_benchmark(
            workload_b(session.base_url, session.model_dir, args, rate, seed_offset)
        )
    result = {key: metrics[key] for key in shared.REPORTED}
    result.update(machine.fields())
    if args.per_request:
        result["requests"] = {key: metrics[key] for key in PER_REQUEST}
    return result


def server_list(model_dir: Path, args: argparse.Namespace) -> list[shared.ServerSpec]:
    wanted = {name.strip() for name in args.servers.split(",")}
    # The same KV cache memory for both: vLLM's CPU backend otherwise sizes its own from free
    # RAM (2.6 GiB here), the engine's default is 512 MiB, and a larger pool keeps more of
    # the shared prefix and of preempted work.
    # Likewise the same scheduler limits (vLLM's CPU server defaults, 128 sequences and 2,048
    # tokens a step; the engine's own are 64 and 512): otherwise the comparison is partly one
    # of defaults.
    kv = args.kv_cache_gib
    limits = ["--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    vllm = shared.vllm_spec(model_dir, args.port, args.threads, args.dtype, args.vllm_preload)
    extra = shlex.split(args.inferops_args)
    specs = [
        shared.inferops_spec(model_dir, args.port, args.threads,
                      ["--kv-cache-memory", f"{kv}GiB", *limits, *extra], args.dtype),
        shared.ServerSpec(vllm.name, [*vllm.command, *limits],
                   {**vllm.env, "VLLM_CPU_KVCACHE_SPACE": str(kv)}),
    ]
    return [spec for spec in specs if spec.name in wanted]


def run_all(model_dir: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    """Each server in turn, at every rate; the first one (inferops) also probes the rate when
    none is given."""
    rates, probe, results = args.request_rate, {}, {}
    for spec in server_list(model_dir, args):
        if spec.name == "vllm" and not VLLM_PYTHON.is_file():
            results[spec.name] = {"skipped": f"{VLLM_PYTHON} missing; run bench/engine/peers.sh"}
            continue
        try:
            with shared.ServerSession(spec, f"online_{spec.name}", model_dir, args) as session:
                if rates is None:
                    probe = probe_saturation_rate(session, args)
                    rates = [round(probe["probe_request_throughput"], 3)]
                # Each rate draws its own prompts (the same for every server at that rate):
                # with one seed for all, a later rate would find the earlier rate's prompts in
                # whichever prefix cache is large enough to keep them.
                by_rate = {
                    str(rate): measure(session, args, rate, spec.name, seed_offset)
                    for seed_offset, rate in enumerate(rates)
                }
        except RuntimeError as error:
            results[spec.name] = {"skipped": str(error)}
            continue
        best = max(by_rate, key=lambda rate: by_rate[rate]["request_goodput"] or 0)
        results[spec.name] = {
            "max_goodput": by_rate[best]["request_goodput"],
            "max_goodput_rate": float(best),
            "by_rate": by_rate,
        }
    return results, {**probe, "request_rates": rates}


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",") if part.strip()]
    if not rates or any(rate <= 0 for rate in rates) or len(set(rates)) < len(rates):
        raise argparse.ArgumentTypeError(
            f"expected distinct positive rates like 4,6,8, not {text!r}"
        )
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8034)
    parser.add_argument("--servers", default="inferops,vllm")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", default="32-512")
    parser.add_argument("--output-len", default="16-256")
    parser.add_argument("--shared-prefix-len", type=int, default=256)
    parser.add_argument("--shared-prefix-ratio", type=float, default=0.3)
    parser.add_argument("--request-rate", type=parse_rates, default=None,
                        help="requests per second, or several (4,6,8) for a sweep with each "
                             "server's best goodput compared (default: probe inferops' rate)")
    parser.add_argument("--probe-prompts", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=int, default=2,
                        help="KV cache memory of each server (GiB)")
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="both servers' limit of sequences in a step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="both servers' token budget of a step")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--inferops-args", default="",
                        help="extra flags for inferops serve only, e.g. "
                             "'--max-prefill-tokens-with-decodes 512'")
    add_dtype_argument(parser)
    add_vllm_preload_argument(parser)
    parser.add_argument("--per-request", action="store_true",
                        help="also record each request's prompt and output lengths, TTFT and "
                             "end-to-end latency (seconds), in arrival order, to study tails")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = shared.benchmark_model(args.model)
    results, rate_info = run_all(model_dir, args)
    report = {**shared.workload_report(args, model_dir), "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
              "rate": rate_info, "servers": results}
    ours, peer = results.get("inferops", {}), results.get("vllm", {})
    if "max_goodput" in ours and "max_goodput" in peer:
        if peer["max_goodput"]:
            report["inferops_over_vllm_goodput"] = round(ours["max_goodput"] / peer["max_goodput"], 3)
        # Best goodput over the rates tried, and a lower p99 TTFT at every one of them.
        report["target_met"] = ours["max_goodput"] >= GOODPUT_RATIO_TARGET * peer["max_goodput"] \
            and all(ours["by_rate"][rate]["p99_ttft_ms"] < peer["by_rate"][rate]["p99_ttft_ms"]
                    for rate in ours["by_rate"])
    shared.emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
