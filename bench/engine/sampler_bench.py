"""Sampling cost per step: the engine's Sampler against vLLM's CPU sampler on the same logits.

For each vocabulary size (tiny's 30,522 and Qwen2's 151,936), spread of the logits and
sampling setting, both samplers draw one token for each of `--rows` rows, `--reps` times,
torch at `--threads`. The logits are made once (Gaussian times the spread: 5 gives a few
candidate tokens as a trained model does, 3 a few hundred, 1 tens of thousands as the random
demo checkpoints do), saved, and loaded by both. vLLM's sampler (`TopKTopPSampler`, which on
CPU applies top-k with topk, top-p with a full sort and draws with its fused Gumbel-argmax
kernel) runs in its own virtualenv (`bench/engine/peers.sh`), without per-request generators,
its fastest path; the engine's sampler has one per row as in serving. Both divide by the
temperature inside the timed region. This process tunes malloc as the serving engine does
(model_runner.keep_freed_memory_for_reuse); vLLM's keeps its defaults, as its server does.
Medians in ms per step go to --result-json.

    .venv/bin/python bench/engine/sampler_bench.py --result-json bench/engine/results/sampler.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from serving_bench import emit_report  # noqa: E402

from runtime.engine.model_runner import keep_freed_memory_for_reuse  # noqa: E402
from runtime.engine.sampling import Sampler, SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = HERE / ".venv-vllm" / "bin" / "python"
VOCABULARIES = {"tiny_30522": 30522, "qwen2_151936": 151936}
SPREADS = {"peaked": 5.0, "hundreds": 3.0, "flat": 1.0}
SETTINGS = {
    "temperature_1": {"temperature": 1.0},
    "top_p_0.9_t0.7": {"temperature": 0.7, "top_p": 0.9},
    "top_k_50_t0.8": {"temperature": 0.8, "top_k": 50},
}

# Runs under vLLM's interpreter after VLLM_TIMER_PREAMBLE: prints {case: [ms, ...]}.
VLLM_TIMER = """
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

sampler = TopKTopPSampler()
for case in spec["cases"]:
    logits = torch.load(case["logits"])
    rows, setting = logits.shape[0], case["setting"]
    k = torch.full((rows,), setting["top_k"]) if "top_k" in setting else None
    p = torch.full((rows,), setting["top_p"]) if "top_p" in setting else None
    temperatures = torch.full((rows, 1), setting["temperature"])
    samples = []
    for rep in range(spec["reps"] + 1):
        started = time.perf_counter()
        sampler.forward(logits / temperatures, {}, k, p)
        samples.append((time.perf_counter() - started) * 1000)
    times[case["name"]] = samples[1:]  # the first call warms up
print(json.dumps(times))
"""


def time_engine_sampler(logits: torch.Tensor, setting: dict, reps: int) -> list[float]:
    rows = logits.shape[0]
    params = [SamplingParams(**setting)] * rows
    generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    sampler = Sampler()
    samples = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        sampler(logits, params, generators)
        samples.append((time.perf_counter() - started) * 1000)
    return samples[1:]


# What every timer run by time_under_vllm starts with: vLLM's compiled ops loaded (the
# Gumbel-argmax kernel, the attention kernels), `spec` read from argv[1] (threads, reps,
# cases), torch's threads set, and `times` for the timer to fill with {case: [ms, ...]}.
VLLM_TIMER_PREAMBLE = """
import json, sys, time
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
spec = json.loads(open(sys.argv[1]).read())
torch.set_num_threads(spec["threads"])
times = {}
"""


def time_under_vllm(timer: str, cases: list[dict], args: argparse.Namespace,
                    ld_preload: str = "") -> dict[str, list[float]] | None:
    """Run `timer` (source that, after VLLM_TIMER_PREAMBLE, times spec["cases"] and prints
    {case: [ms, ...]} last) under vLLM's interpreter, with `ld_preload` if given; None, and a
    note, where vLLM's virtualenv is missing."""
    if not VLLM_PYTHON.exists():
        print(f"no {VLLM_PYTHON}: run bench/engine/peers.sh for the vLLM side", file=sys.stderr)
        return None
    print("vLLM: all cases ...", file=sys.stderr)
    spec_path = args.work_dir / "cases.json"
    spec_path.write_text(json.dumps({"threads": args.threads, "reps": args.reps, "cases": cases}))
    completed = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_TIMER_PREAMBLE + timer, str(spec_path)],
        capture_output=True, text=True, check=True,
        env={**os.environ, **({"LD_PRELOAD": ld_preload} if ld_preload else {})})
    return json.loads(completed.stdout.strip().splitlines()[-1])


def nucleus_size(logits: torch.Tensor, setting: dict) -> float:
    """Median number of tokens a row keeps (the whole vocabulary without top-k / top-p)."""
    probs = Sampler.probabilities(logits, [SamplingParams(**setting)] * logits.shape[0])
    return statistics.median((probs > 0).sum(dim=-1).tolist())


def add_timing_arguments(parser: argparse.ArgumentParser, reps: int, work_dir: str) -> None:
    """What the benches that time one operation against vLLM's (time_under_vllm) share."""
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=HERE / "work" / work_dir)
    parser.add_argument("--result-json", type=Path, default=None)


def start_timing(args: argparse.Namespace, *, keep_freed_memory: bool = True) -> argparse.Namespace:
    """Set up as the serving engine runs: torch's threads as asked and, unless told not to, freed
    memory kept for reuse (model_runner.py does it at start); the work dir made."""
    torch.set_num_threads(args.threads)
    if keep_freed_memory:
        keep_freed_memory_for_reuse()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    add_timing_arguments(parser, reps=7, work_dir="sampler")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = start_timing(parse_args(argv))
    cases, results = [], {}
    for vocab_name, vocab in VOCABULARIES.items():
        for spread_name, spread in SPREADS.items():
            generator = torch.Generator().manual_seed(args.seed)
            logits = torch.randn(args.rows, vocab, generator=generator) * spread
            path = args.work_dir / f"logits_{vocab_name}_{spread_name}.pt"
            torch.save(logits, path)
            for setting_name, setting in SETTINGS.items():
                name = f"{vocab_name}/{spread_name}/{setting_name}"
                print(f"engine sampler: {name}", file=sys.stderr)
                cases.append({"name": name, "logits": str(path), "setting": setting})
                results[name] = {
                    "kept_tokens_median": nucleus_size(logits, setting),
                    "engine_ms": statistics.median(time_engine_sampler(logits, setting, args.reps)),
                }
    vllm_times = time_under_vllm(VLLM_TIMER, cases, args)
    for name, samples in (vllm_times or {}).items():
        result = results[name]
        result["vllm_ms"] = statistics.median(samples)
        result["vllm_over_engine"] = round(result["vllm_ms"] / result["engine_ms"], 2)
    report = {"rows": args.rows, "reps": args.reps, "threads": args.threads, "cases": results}
    emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
