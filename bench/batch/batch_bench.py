"""Offline batches beside interactive traffic on one replica (issue 41's figures).

On one `inferops serve` replica of the tiny demo model, in one run:

1. saturation: a burst of interactive requests, all at once; its output tokens a second are what the
   replica can do at most (its measured saturation), its requests a second the saturation rate;
2. interactive alone (the peer): Poisson arrivals at `--load` (0.6) of that rate;
3. the same interactive requests (same seed, prompts and arrival times) while a large batch runs on
   the same replica through the batch runner's own feeder (batches.runner.Feeder: lowest priority,
   the window that follows the replica's queue).

Steps 2 and 3 repeat `--rounds` times, each round with its own seed, every other round in the other
order. Figures, over every round's
requests together: how much interactive TTFT p99 moved (target: <= 10 %), and the batch's output
tokens a second during the interactive runs as a share of what the interactive traffic left of the
replica's saturation (target: >= 70 %). The feeder reads the route from Redis (`--redis-url`, a database of its
own: the script publishes the route there and deletes the keys it wrote after) and writes each
line's usage event to that database's stream; no Postgres is touched.

    .venv/bin/python bench/batch/batch_bench.py --result-json bench/batch/results/batch-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import queue
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))
sys.path.insert(0, str(HERE.parents[1]))

import engine_runs as shared  # noqa: E402

from runtime.loadgen import BenchConfig, LengthRange, run_benchmark  # noqa: E402

TTFT_MOVE_TARGET = 0.10
BATCH_SHARE_TARGET = 0.70


def interactive(base_url: str, model_dir: Path, args: argparse.Namespace, rate: float, prompts: int) -> BenchConfig:
    return BenchConfig(base_url=base_url, model=shared.SERVED_NAME, num_prompts=prompts, request_rate=rate,
                       input_len=LengthRange.parse(args.input_len), output_len=LengthRange.parse(args.output_len),
                       tokenizer_dir=str(model_dir), seed=args.seed, show_progress=False)


class BatchRun:
    """The batch runner's Feeder in a process of its own (as on a batch worker: not sharing the load
    generator's interpreter), fed `--batch-lines` chat requests; finished lines come back timed, so the
    tokens inside any window can be counted."""

    def __init__(self, base_url: str, args: argparse.Namespace):
        context = multiprocessing.get_context("fork")
        self.queue = context.Queue()
        self.stop = context.Event()
        self.process = context.Process(target=_feed, args=(args.batch_lines, args.batch_output_len, self.queue,
                                                           self.stop), daemon=True)
        self.finished: list[tuple[float, bool, int]] = []
        self.windows: dict = {}

    def tokens_between(self, start: float, end: float) -> int:
        self._drain()
        return sum(tokens for at, ok, tokens in self.finished if start <= at <= end and ok)

    def _drain(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=0.2)
            except queue.Empty:
                return
            if item[0] == "windows":
                self.windows = item[1]
            else:
                self.finished.append(item)

    def __enter__(self) -> BatchRun:
        self.process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.process.join(30)
        self._drain()


def _feed(lines: int, output_len: int, out, stop) -> None:
    from batches.models import Batch
    from batches.runner import Feeder, Line
    from tenants.models import Tenant

    class Progress:  # what the Feeder reads and appends to (batches.runner.Progress)
        def __init__(self):
            self.stop = stop
            self.outcomes = self

        def append(self, outcome) -> None:
            out.put((time.time(), outcome.ok, outcome.completion_tokens))

    batch = Batch(id="batch_bench", model=shared.SERVED_NAME, endpoint="/v1/chat/completions", key_prefix="bench",
                  tenant=Tenant(name="bench"))
    pending = [Line(i + 1, f"line-{i}", {
        "model": shared.SERVED_NAME, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": " ".join(f"document {i} word {j}" for j in range(12))}]})
        for i in range(lines)]
    feeder = Feeder(batch, pending, Progress())
    asyncio.run(feeder.run())
    out.put(("windows", {target.id: target.window for target in feeder.targets.values()}))


def publish_route(redis_url: str, base_url: str) -> None:
    import redis

    from runtime.gateway.contract import ROUTING_KEY

    route = {"deployment": shared.SERVED_NAME, "model": shared.SERVED_NAME, "task": "generate", "backend": "builtin",
             "versions": [{"version": 1, "track": "stable", "weight": 100, "replicas": [{"id": 1, "url": base_url}]}],
             "published_at": time.time(), "degradation": None}
    redis.Redis.from_url(redis_url).hset(ROUTING_KEY, shared.SERVED_NAME, json.dumps(route))


def forget(redis_url: str) -> None:
    import redis

    from runtime.gateway.contract import ROUTING_KEY, USAGE_STREAM

    client = redis.Redis.from_url(redis_url)
    client.hdel(ROUTING_KEY, shared.SERVED_NAME)
    client.delete(USAGE_STREAM)


KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
        "median_tpot_ms", "p99_tpot_ms")


def one_round(base: str, model_dir: Path, args: argparse.Namespace, rate: float, saturation_tok_s: float,
              seed: int, batch_first: bool) -> dict:
    """Interactive alone and the same requests (same seed) beside a fresh batch, in the order given:
    rounds alternate it, so neither side always follows the other's leftovers."""
    args.seed = seed

    def alone() -> tuple[dict, dict]:
        print(f"round seed {seed}: interactive alone at {rate:.2f} req/s ...", file=sys.stderr)
        with shared.MachineLoad() as machine:
            metrics = run_benchmark(interactive(base, model_dir, args, rate, args.num_prompts))
        return metrics, machine.fields()

    def beside() -> tuple[dict, dict, dict]:
        with BatchRun(base, args) as batch:
            time.sleep(args.batch_lead_s)  # the batch's window opens up before the interactive run
            print(f"round seed {seed}: interactive at {rate:.2f} req/s beside the batch ...", file=sys.stderr)
            with shared.MachineLoad() as machine:
                start = time.time()
                metrics = run_benchmark(interactive(base, model_dir, args, rate, args.num_prompts))
                end = time.time()
        tokens = batch.tokens_between(start, end)
        windows = batch.windows
        return metrics, machine.fields(), {"output_tokens_in_window": tokens, "window_s": end - start,
                                           "output_tok_s": tokens / (end - start), "final_windows": windows}

    if batch_first:
        beside_metrics, beside_machine, batch = beside()
        alone_metrics, alone_machine = alone()
    else:
        alone_metrics, alone_machine = alone()
        beside_metrics, beside_machine, batch = beside()
    batch["remaining_capacity_tok_s"] = remaining = saturation_tok_s - beside_metrics["output_throughput"]
    return {
        "seed": seed, "batch_first": batch_first,
        "ttfts_ms": {"alone": _ttfts_ms(alone_metrics), "beside": _ttfts_ms(beside_metrics)},
        "interactive_alone": {**{key: alone_metrics[key] for key in KEEP}, **alone_machine},
        "interactive_beside_batch": {**{key: beside_metrics[key] for key in KEEP}, **beside_machine},
        "batch": batch,
        "ttft_p99_move": beside_metrics["p99_ttft_ms"] / alone_metrics["p99_ttft_ms"] - 1,
        "batch_share_of_remaining": batch["output_tok_s"] / remaining if remaining > 0 else None,
    }


def _ttfts_ms(metrics: dict) -> list[float]:
    return [ttft * 1000 for ttft in metrics["ttfts"] if ttft is not None]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    rank = 0.99 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure(session, model_dir: Path, args: argparse.Namespace) -> dict:
    base = session.base_url
    print("saturation: a burst of interactive requests ...", file=sys.stderr)
    saturation = run_benchmark(interactive(base, model_dir, args, math.inf, args.saturation_prompts))
    rate = args.load * saturation["request_throughput"]
    publish_route(args.redis_url, base)
    try:
        first_seed = args.seed
        rounds = [one_round(base, model_dir, args, rate, saturation["output_throughput"], first_seed + i,
                            batch_first=i % 2 == 1) for i in range(args.rounds)]
    finally:
        forget(args.redis_url)
    # The p99 of one round's few hundred requests is its two or three slowest: one hiccup of a shared
    # 2-core machine moves it by 10x. The figure pools every round's requests, alone and beside.
    alone_ttfts = [t for r in rounds for t in r["ttfts_ms"]["alone"]]
    beside_ttfts = [t for r in rounds for t in r["ttfts_ms"]["beside"]]
    for r in rounds:
        del r["ttfts_ms"]
    move = p99(beside_ttfts) / p99(alone_ttfts) - 1
    batch_tokens = sum(r["batch"]["output_tokens_in_window"] for r in rounds)
    batch_seconds = sum(r["batch"]["window_s"] for r in rounds)
    remaining = statistics.mean(r["batch"]["remaining_capacity_tok_s"] for r in rounds)
    share = batch_tokens / batch_seconds / remaining if remaining > 0 else None
    return {
        "saturation": {key: saturation[key] for key in KEEP},
        "interactive_rate": rate,
        "rounds": rounds,
        "figures": {
            "ttft_p99_alone_ms": p99(alone_ttfts), "ttft_p99_beside_ms": p99(beside_ttfts),
            "requests_each_side": len(alone_ttfts),
            "ttft_p99_move": move, "ttft_p99_move_target": TTFT_MOVE_TARGET,
            "ttft_p99_met": move <= TTFT_MOVE_TARGET,
            "batch_output_tok_s": batch_tokens / batch_seconds, "remaining_capacity_tok_s": remaining,
            "batch_share_of_remaining": share, "batch_share_target": BATCH_SHARE_TARGET,
            "batch_share_met": share is not None and share >= BATCH_SHARE_TARGET,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8131)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--load", type=float, default=0.6, help="interactive rate as a share of saturation")
    parser.add_argument("--num-prompts", type=int, default=300, help="interactive requests a round and side")
    parser.add_argument("--saturation-prompts", type=int, default=128)
    parser.add_argument("--input-len", default="32-256")
    parser.add_argument("--output-len", default="32-128")
    parser.add_argument("--batch-lines", type=int, default=5000)
    parser.add_argument("--batch-output-len", type=int, default=128)
    parser.add_argument("--batch-lead-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=4,
                        help="alone/beside pairs, each with its own seed; the figures are their medians")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-inflight", type=int, default=None,
                        help="INFEROPS_BATCH_MAX_INFLIGHT_PER_REPLICA for the feeder (default: the setting's)")
    parser.add_argument("--inferops-args", default="",
                        help="more `inferops serve` flags, e.g. \"--background-tokens-per-step 8\"")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The feeder reads Django settings (Redis URL, its limits); nothing here opens Postgres.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://unused@127.0.0.1:1/unused")
    os.environ["REDIS_URL"] = args.redis_url
    if args.max_inflight is not None:
        os.environ["INFEROPS_BATCH_MAX_INFLIGHT_PER_REPLICA"] = str(args.max_inflight)
    import django

    django.setup()
    model_dir = shared.benchmark_model(args.model)
    spec = shared.inferops_spec(model_dir, args.port, args.threads,
                                ["--max-num-seqs", str(args.max_num_seqs), *args.inferops_args.split()])
    with shared.ServerSession(spec, "batch_inferops", model_dir, args) as session:
        result = measure(session, model_dir, args)
    report = {**shared.workload_report(args, model_dir), **result, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                           time.gmtime())}
    figures = result["figures"]
    for r in result["rounds"]:
        print(f"seed {r['seed']}: interactive TTFT p99 {r['interactive_alone']['p99_ttft_ms']:.1f} ms alone, "
              f"{r['interactive_beside_batch']['p99_ttft_ms']:.1f} ms beside the batch ({r['ttft_p99_move']:+.1%}); "
              f"batch {r['batch']['output_tok_s']:.0f} tok/s of {r['batch']['remaining_capacity_tok_s']:.0f} left "
              f"({r['batch_share_of_remaining'] or 0:.0%})")
    print(f"all rounds: TTFT p99 {figures['ttft_p99_alone_ms']:.1f} ms alone, {figures['ttft_p99_beside_ms']:.1f} ms "
          f"beside ({figures['ttft_p99_move']:+.1%}, target <= {TTFT_MOVE_TARGET:.0%}); batch "
          f"{figures['batch_output_tok_s']:.0f} tok/s of {figures['remaining_capacity_tok_s']:.0f} left "
          f"({figures['batch_share_of_remaining'] or 0:.0%}, target >= {BATCH_SHARE_TARGET:.0%})")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
