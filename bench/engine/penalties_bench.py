"""Penalties and logprobs per step: the engine's against vLLM's CPU code on the same inputs.

For each vocabulary size (tiny's 30,522 and Qwen2's 151,936) and batch (`--rows`), every row
has a `--prompt-len`-token prompt and a `--output-len`-token output of random token ids. Timed,
`--reps` times each, torch at `--threads`:

- `repetition`, `frequency_presence`, `all_three`: the engine's `sampling.apply_penalties` with
  each sequence's distinct prompt ids made once, as the engine keeps them, against vLLM's
  `apply_all_penalties` (dense token counts over [rows, vocabulary]) with its padded prompt
  tensor made once, as its input batch keeps it. Output token lists are handed over as they
  are; each side builds what it needs from them inside the timed region.
- `logprobs_5`: the engine's path (log-softmax of the rows, then `token_logprobs`: the sampled
  token's logprob and the 5 most likely, as Python values) against vLLM's (`compute_logprobs`,
  `gather_logprobs`, which also ranks the sampled token, then `tolists()`, which stops at
  numpy arrays: its output processor makes Python values of them later, outside this timing).

Both modify their own copy of the logits, made outside the timed region. vLLM's code runs in
its own virtualenv (`bench/engine/peers.sh`), with the `LD_PRELOAD` its CPU guide asks for
unless `--vllm-preload none`. Medians in ms per step go to --result-json, with
a check that both sides produced the same penalised logits and logprobs.

    .venv/bin/python bench/engine/penalties_bench.py --result-json bench/engine/results/penalties.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from sampler_bench import VOCABULARIES, add_timing_arguments, start_timing, time_under_vllm  # noqa: E402
from serving_bench import add_vllm_preload_argument, emit_report, vllm_ld_preload  # noqa: E402

from runtime.engine.sampling import SamplingParams, apply_penalties, token_logprobs  # noqa: E402

SETTINGS = {
    "repetition": {"repetition_penalty": 1.1},
    "frequency_presence": {"frequency_penalty": 0.5, "presence_penalty": 0.5},
    "all_three": {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "logprobs_5": {"logprobs": 5},
}

# Runs under vLLM's interpreter after sampler_bench.VLLM_TIMER_PREAMBLE: prints
# {case: [ms, ...]} and saves each case's result next to its inputs for the comparison.
VLLM_TIMER = """
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.sampler import Sampler

for case in spec["cases"]:
    inputs = torch.load(case["inputs"])
    logits, setting = inputs["logits"], case["setting"]
    rows, vocab = logits.shape
    samples = []
    for rep in range(spec["reps"] + 1):
        work = logits.clone()
        started = time.perf_counter()
        if "logprobs" in setting:
            logprobs = Sampler.compute_logprobs(work)
            result = Sampler.gather_logprobs(logprobs, setting["logprobs"],
                                             inputs["sampled"]).tolists()
        else:
            per_row = lambda name, off: torch.full((rows,), float(setting.get(name, off)))
            result = apply_all_penalties(
                work, inputs["padded_prompts"], per_row("presence_penalty", 0),
                per_row("frequency_penalty", 0), per_row("repetition_penalty", 1),
                inputs["outputs"])
        samples.append((time.perf_counter() - started) * 1000)
    times[case["name"]] = samples[1:]  # the first call warms up (and compiles)
    if isinstance(result, tuple):  # LogprobsLists, as plain lists for the other interpreter
        result = tuple(getattr(field, "tolist", lambda f=field: f)() for field in result)
    torch.save(result, case["vllm_result"])
print(json.dumps(times))
"""


def make_inputs(vocab: int, rows: int, prompt_len: int, output_len: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(vocab, (rows, prompt_len), generator=generator)
    outputs = torch.randint(vocab, (rows, output_len), generator=generator)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    return {"logits": logits, "padded_prompts": prompts, "outputs": outputs.tolist(),
            "sampled": logits.argmax(dim=-1)}


def time_engine(inputs: dict, setting: dict, reps: int) -> tuple[list[float], object]:
    logits, outputs = inputs["logits"], inputs["outputs"]
    rows = logits.shape[0]
    params = [SamplingParams(**setting)] * rows
    distinct_prompts = [p.unique() for p in inputs["padded_prompts"]]  # once a sequence
    sampled = inputs["sampled"].tolist()
    samples, result = [], None
    for _ in range(reps + 1):
        work = logits.clone()
        started = time.perf_counter()
        if "logprobs" in setting:
            result = token_logprobs(work.log_softmax(dim=-1), sampled,
                                    [setting["logprobs"]] * rows)
        else:
            apply_penalties(work, list(range(rows)), params, distinct_prompts, outputs)
            result = work
        samples.append((time.perf_counter() - started) * 1000)
    return samples[1:], result


def same_result(engine_result, vllm_result) -> bool:
    """The same penalised logits, or the same logprobs (vLLM lists the sampled token first)."""
    if isinstance(engine_result, torch.Tensor):
        return torch.allclose(engine_result, vllm_result, atol=1e-5)
    ids, values = vllm_result[0], vllm_result[1]  # then ranks, and batch offsets
    return all(
        row_ids[0] == entry.token_id and [i for i, _ in entry.top] == row_ids[1:]
        and abs(row_values[0] - entry.logprob) < 1e-4
        for entry, row_ids, row_values in zip(engine_result, ids, values, strict=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="32,128", help="batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    add_timing_arguments(parser, reps=7, work_dir="penalties")
    add_vllm_preload_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = start_timing(parse_args(argv))
    cases, results, engine_results = [], {}, {}
    for vocab_name, vocab in VOCABULARIES.items():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = make_inputs(vocab, rows, args.prompt_len, args.output_len, args.seed)
            path = args.work_dir / f"inputs_{vocab_name}_{rows}.pt"
            torch.save(inputs, path)
            for setting_name, setting in SETTINGS.items():
                name = f"{vocab_name}/{rows}_rows/{setting_name}"
                print(f"engine: {name}", file=sys.stderr)
                samples, engine_results[name] = time_engine(inputs, setting, args.reps)
                results[name] = {"engine_ms": round(statistics.median(samples), 3)}
                cases.append({"name": name, "inputs": str(path), "setting": setting,
                              "vllm_result": str(args.work_dir / f"vllm_{len(cases)}.pt")})
    vllm_times = time_under_vllm(VLLM_TIMER, cases, args, vllm_ld_preload(args.vllm_preload))
    for case in cases if vllm_times else []:
        result = results[case["name"]]
        result["vllm_ms"] = round(statistics.median(vllm_times[case["name"]]), 3)
        result["vllm_over_engine"] = round(result["vllm_ms"] / result["engine_ms"], 2)
        result["same_result"] = same_result(engine_results[case["name"]],
                                            torch.load(case["vllm_result"]))
    report = {"prompt_len": args.prompt_len, "output_len": args.output_len, "reps": args.reps,
              "threads": args.threads, "vllm_ld_preload": vllm_ld_preload(args.vllm_preload),
              "cases": results}
    emit_report(report, args.result_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
