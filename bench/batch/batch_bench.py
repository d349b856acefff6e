"""Offline batches beside interactive traffic on one replica (issue 41's figures).

On one `inferops serve` replica of the tiny demo model, in one run:

1. saturation: a burst of interactive requests, all at once; its output tokens a second are what the
   replica can do at most (its measured saturation), its requests a second the saturation rate;
2. interactive alone (the peer): Poisson arrivals at `--load` (0.6) of that rate;
3. the same interactive requests (same seed, prompts and arrival times) while a large batch runs on
   the same replica through the batch runner's own feeder (batches.runner.Feeder: lowest priority,
   the window that follows the replica's queue).

Figures: how much interactive TTFT p99 moved (target: <= 10 %), and the batch's output tokens a
second during the interactive run as a share of what the interactive traffic left of the replica's
saturation (target: >= 70 %). The feeder reads the route from Redis (`--redis-url`, a database of its
own: the script publishes the route there and deletes the keys it wrote after) and writes each
line's usage event to that database's stream; no Postgres is touched.

    .venv/bin/python bench/batch/batch_bench.py --result-json bench/batch/results/batch-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
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
    """The batch runner's Feeder on a thread of its own, fed `lines` chat requests; finished lines are
    timed as they arrive, so the tokens inside any window can be counted."""

    def __init__(self, base_url: str, args: argparse.Namespace):
        from batches.models import Batch
        from batches.runner import Feeder, Line
        from tenants.models import Tenant

        self.finished: list[tuple[float, object]] = []
        self.stop = threading.Event()
        batch = Batch(id="batch_bench", model=shared.SERVED_NAME, endpoint="/v1/chat/completions",
                      key_prefix="bench", tenant=Tenant(name="bench"))
        lines = [Line(i + 1, f"line-{i}", {
            "model": shared.SERVED_NAME, "max_tokens": args.batch_output_len, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": " ".join(f"document {i} word {j}" for j in range(12))}]})
            for i in range(args.batch_lines)]
        self.feeder = Feeder(batch, lines, self)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.feeder.run()), daemon=True)

    @property
    def outcomes(self):  # the Feeder appends here (Progress.outcomes in the runner)
        return self

    def append(self, outcome) -> None:
        self.finished.append((time.perf_counter(), outcome))

    def tokens_between(self, start: float, end: float) -> int:
        return sum(o.completion_tokens for at, o in self.finished if start <= at <= end and o.ok)

    def __enter__(self) -> BatchRun:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


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


def measure(session, model_dir: Path, args: argparse.Namespace) -> dict:
    base = session.base_url
    print("saturation: a burst of interactive requests ...", file=sys.stderr)
    saturation = run_benchmark(interactive(base, model_dir, args, math.inf, args.saturation_prompts))
    rate = args.load * saturation["request_throughput"]
    print(f"interactive alone at {rate:.2f} req/s ...", file=sys.stderr)
    with shared.MachineLoad() as machine:
        alone = run_benchmark(interactive(base, model_dir, args, rate, args.num_prompts))
    alone_machine = machine.fields()
    publish_route(args.redis_url, base)
    try:
        with BatchRun(base, args) as batch:
            time.sleep(args.batch_lead_s)  # the batch's window opens up before the interactive run
            print(f"interactive at {rate:.2f} req/s beside the batch ...", file=sys.stderr)
            with shared.MachineLoad() as machine:
                start = time.perf_counter()
                beside = run_benchmark(interactive(base, model_dir, args, rate, args.num_prompts))
                end = time.perf_counter()
            batch_tokens = batch.tokens_between(start, end)
            windows = {target.id: target.window for target in batch.feeder.targets.values()}
    finally:
        forget(args.redis_url)
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    batch_tok_s = batch_tokens / (end - start)
    remaining = saturation["output_throughput"] - beside["output_throughput"]
    ttft_move = beside["p99_ttft_ms"] / alone["p99_ttft_ms"] - 1
    share = batch_tok_s / remaining if remaining > 0 else None
    return {
        "saturation": {key: saturation[key] for key in keep},
        "interactive_rate": rate,
        "interactive_alone": {**{key: alone[key] for key in keep}, **alone_machine},
        "interactive_beside_batch": {**{key: beside[key] for key in keep}, **machine.fields()},
        "batch": {"output_tokens_in_window": batch_tokens, "window_s": end - start,
                  "output_tok_s": batch_tok_s, "remaining_capacity_tok_s": remaining, "final_windows": windows},
        "figures": {
            "ttft_p99_move": ttft_move, "ttft_p99_move_target": TTFT_MOVE_TARGET,
            "ttft_p99_met": ttft_move <= TTFT_MOVE_TARGET,
            "batch_share_of_remaining": share, "batch_share_target": BATCH_SHARE_TARGET,
            "batch_share_met": share is not None and share >= BATCH_SHARE_TARGET,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8131)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--load", type=float, default=0.6, help="interactive rate as a share of saturation")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--saturation-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32-256")
    parser.add_argument("--output-len", default="32-128")
    parser.add_argument("--batch-lines", type=int, default=5000)
    parser.add_argument("--batch-output-len", type=int, default=128)
    parser.add_argument("--batch-lead-s", type=float, default=3.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--inferops-args", default="", help="more `inferops serve` flags")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The feeder reads Django settings (Redis URL, its limits); nothing here opens Postgres.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DATABASE_URL", "postgres://unused@127.0.0.1:1/unused")
    os.environ["REDIS_URL"] = args.redis_url
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
    print(f"interactive TTFT p99 {result['interactive_alone']['p99_ttft_ms']:.1f} ms alone, "
          f"{result['interactive_beside_batch']['p99_ttft_ms']:.1f} ms beside the batch "
          f"({figures['ttft_p99_move']:+.1%}, target <= {TTFT_MOVE_TARGET:.0%}); batch "
          f"{result['batch']['output_tok_s']:.0f} tok/s of {result['batch']['remaining_capacity_tok_s']:.0f} left "
          f"({figures['batch_share_of_remaining'] or 0:.0%}, target >= {BATCH_SHARE_TARGET:.0%})")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
