"""Scoring text the way lm-evaluation-harness does: `inferops serve` against vLLM.

An eval harness scores a text's loglikelihood through an OpenAI completions endpoint with
`echo: true, logprobs: 1, max_tokens: 1` (lm-evaluation-harness's `local-completions`): the
reply carries every prompt token's logprob. Each server is started in turn on the same
checkpoint (one up at a time, as in serving_bench.py), warmed up, and sent `--num-prompts`
prompts of `--prompt-len` random token ids (the same ids for both), `--max-concurrency` at a
time, `--rounds` times. Reported per server: prompt tokens scored a second (median over
rounds), request latency, and how far its summed prompt logprobs are from the other server's
on the same prompts (both float32: they should agree to rounding).

    .venv/bin/python bench/engine/scoring_bench.py --result-json bench/engine/results/scoring.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_runs as shared  # noqa: E402
from serving_bench import add_vllm_preload_argument, vllm_ld_preload  # noqa: E402

from runtime.engine.config import ModelConfig  # noqa: E402


def scoring_prompts(model_dir: Path, args: argparse.Namespace) -> list[list[int]]:
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    rng = random.Random(args.seed)
    # Away from the low ids, where BERT-style vocabularies keep their special tokens.
    return [[rng.randrange(1000, vocab) for _ in range(args.prompt_len)]
            for _ in range(args.num_prompts)]


async def score_all(base_url: str, prompts: list[list[int]],
                    concurrency: int) -> tuple[float, list[float], list[float]]:
    """(seconds for all, per-request seconds, per-prompt summed logprobs)."""
    limit = asyncio.Semaphore(concurrency)
    latencies, sums = [0.0] * len(prompts), [0.0] * len(prompts)

    async def score(client: httpx.AsyncClient, index: int) -> None:
        async with limit:
            started = time.perf_counter()
            response = await client.post(f"{base_url}/v1/completions", json={
                "model": shared.SERVED_NAME, "prompt": prompts[index], "echo": True, "logprobs": 1,
                "max_tokens": 1, "temperature": 0})
            latencies[index] = time.perf_counter() - started
            response.raise_for_status()
            logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
            # The prompt's tokens after the first; the generated one is not scored.
            sums[index] = sum(logprobs[1:len(prompts[index])])

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(score(client, i) for i in range(len(prompts))))
        return time.perf_counter() - started, latencies, sums


def bench_one(name: str, model_dir: Path, prompts: list[list[int]],
              args: argparse.Namespace) -> dict:
    spec = (shared.inferops_spec(model_dir, args.port, args.threads, []) if name == "inferops"
            else shared.vllm_spec(model_dir, args.port, args.threads, preload=args.vllm_preload))
    rounds, sums = [], []
    try:
        with shared.ServerSession(spec, f"scoring_{name}", model_dir, args, warm=False) as session:
            asyncio.run(score_all(session.base_url, prompts[:4], 2))  # warm-up, not timed
            for round_number in range(1, args.rounds + 1):
                print(f"{name}: round {round_number}", file=sys.stderr)
                with shared.MachineLoad() as machine:
                    seconds, latencies, sums = asyncio.run(
                        score_all(session.base_url, prompts, args.max_concurrency))
                rounds.append({
                    "seconds": round(seconds, 3),
                    "prompt_tokens_per_s": round(len(prompts) * args.prompt_len / seconds, 1),
                    "median_latency_ms": round(statistics.median(latencies) * 1000, 1),
                    **machine.fields(),
                })
    except (RuntimeError, httpx.HTTPError) as error:
        return {"skipped": str(error)}
    return {"median_prompt_tokens_per_s": statistics.median(
                r["prompt_tokens_per_s"] for r in rounds),
            "rounds": rounds, "summed_logprobs": sums}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared.add_run_arguments(parser, port=8035)
    parser.add_argument("--servers", default="inferops,vllm")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    add_vllm_preload_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = shared.benchmark_model(args.model)
    prompts = scoring_prompts(model_dir, args)
    servers = {name: bench_one(name, model_dir, prompts, args)
               for name in (n.strip() for n in args.servers.split(","))}
    report = {**shared.workload_report(args, model_dir), "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
              "servers": servers}
    ours, peer = servers.get("inferops", {}), servers.get("vllm", {})
    if "rounds" in ours and "rounds" in peer:
        report["inferops_over_vllm_prompt_tokens_per_s"] = round(
            ours["median_prompt_tokens_per_s"] / peer["median_prompt_tokens_per_s"], 3)
        report["max_summed_logprob_difference"] = max(
            abs(a - b) for a, b in zip(ours["summed_logprobs"], peer["summed_logprobs"],
                                       strict=True))
    for result in servers.values():
        result.pop("summed_logprobs", None)
    shared.emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
