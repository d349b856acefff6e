"""The engine at this checkout against the engine at another revision, in process, on the CPU.

Workload A's shape in process (`LLMEngine.generate`: 64 prompts of 512 tokens, 128 output tokens
each, greedy, ignore_eos) on the tiny demo checkpoint. Each round runs both trees in fresh
processes, one after the other, alternating which goes first; the figure is output tokens a second,
with the ratio of the medians and the median of the rounds' ratios. It answers "did this change
make the CPU path slower?" without a server, a client or vLLM in the measurement.

    python bench/engine/revision_bench.py --baseline ae2d171 --rounds 4 \\
        --result-json bench/engine/results/revision_issue43.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "bench" / "engine" / "work" / "tiny"
PROMPTS, INPUT_LEN, OUTPUT_LEN = 64, 512, 128

ONE_RUN = """
import json, random, sys, time
sys.path.insert(0, {tree!r})
import torch
torch.set_num_threads({threads})
from runtime.engine.config import EngineConfig
from runtime.engine.engine import LLMEngine
from runtime.engine.sampling import SamplingParams
engine = LLMEngine(EngineConfig(model={model!r}, max_num_seqs=64, max_num_batched_tokens=2048))
rng = random.Random(0)
prompts = [[rng.randrange(1000, 30000) for _ in range({input_len})] for _ in range({prompts})]
engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
started = time.monotonic()
outputs = engine.generate(prompts, SamplingParams(max_tokens={output_len}, temperature=0, ignore_eos=True))
elapsed = time.monotonic() - started
print(json.dumps({{"tokens": sum(map(len, outputs)), "seconds": elapsed}}))
"""


def run_once(tree: Path, model: Path, threads: int) -> float:
    code = ONE_RUN.format(tree=str(tree), model=str(model), threads=threads, input_len=INPUT_LEN,
                          prompts=PROMPTS, output_len=OUTPUT_LEN)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=tree)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["tokens"] / result["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the git revision to compare against")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (default: the tiny demo)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inferops-baseline-") as scratch:
        baseline = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(baseline),
                        args.baseline], check=True)
        try:
            figures: dict[str, list[float]] = {"this checkout": [], args.baseline: []}
            for index in range(args.rounds):
                order = [("this checkout", ROOT), (args.baseline, baseline)]
                for name, tree in order if index % 2 == 0 else reversed(order):
                    figures[name].append(round(run_once(tree, args.model, args.threads), 1))
                done = ", ".join(f"{name} {values[-1]} tok/s" for name, values in figures.items())
                print(f"round {index + 1}/{args.rounds}: {done}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    head, base = (statistics.median(v) for v in figures.values())
    # Round by round: the two runs of a round saw about the same machine, so their ratio drifts less.
    pairs = [round(a / b, 3) for a, b in zip(*figures.values(), strict=True)]
    result = {"workload": {"prompts": PROMPTS, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN},
              "model": str(args.model), "threads": args.threads, "rounds": args.rounds,
              "revision": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                         capture_output=True, text=True).stdout.strip(),
              "baseline": args.baseline, "output_tok_s": figures,
              "median_tok_s": {"this checkout": head, args.baseline: base},
              "ratio_of_medians": round(head / base, 3), "ratio_per_round": pairs,
              "median_ratio_per_round": statistics.median(pairs),
              "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "loadavg": os.getloadavg()}
    print(json.dumps({key: result[key] for key in ("median_tok_s", "ratio_of_medians", "median_ratio_per_round")}))
    if args.result_json:
        args.result_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
