"""`choice` scores equal lm-evaluation-harness's on the same cases against the same replica.

One real `inferops serve` of the tiny checkpoint; the cases are scored twice: by our client and
scorers, and by lm-eval (from PyPI) through its OpenAI-compatible completions model
("local-completions", token-id requests, the checkpoint's own tokenizer) on a task defined here
as YAML over a local JSONL file, offline. acc, acc_norm and every choice's log-likelihood
must agree.

lm-eval's acc_norm divides by the choice's length in characters, ours by its UTF-8 bytes (the
issue's definition); the choices here are ASCII, where the two are the same number.
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from evals.scoring.client import ReplicaClient
from evals.scoring.scorers import score_case, summarise
from tests.evals.replica import MODEL

TASK = "inferops_choice_parity"

# (context, choices, answer): contexts with and without trailing spaces, choices of very
# different byte lengths (so summed and per-byte argmaxes can part), words the tiny
# tokenizer knows and words it spells byte by byte.
CASES = [
    ("The quick brown fox jumps over the", [" lazy dog.", " cat", " moon and the stars"], 0),
    ("The quick brown", [" fox", " dog", " elephant in the room"], 0),
    ("Hello", [" world!", " there", ","], 0),
    ("Hello world! This is a tiny", [" tokenizer", " model", " test for engines"], 0),
    ("Paged attention stores keys and values in", [" fixed-size blocks.", " a list", " RAM"], 0),
    ("Continuous batching mixes prefill chunks with", [" decode steps.", " tea", " nothing"], 0),
    ("Service level objectives keep latency", [" honest", " low", " p99 under a second"], 0),
    ("Answer: ", ["yes", "no", "maybe so"], 1),
    ("Q: Is the sky blue?\nA:", [" yes", " no"], 0),
    ("Q: 2 + 2 =", [" 4", " 5", " twenty-two"], 0),
    ("The capital of France is", [" Paris", " Lyon", " a city on the Seine"], 0),
    ("Colour: ", ["red", "blue", "green", "a very dark purple"], 2),
    ("p50, p90,", [" p99", " p95", " p100 and beyond"], 0),
    ("Keys and values", [" in blocks", " everywhere", "."], 2),
    ("The lazy", [" dog", " fox", " brown dog sleeps all day"], 0),
    ("Tiny tokenizer for", [" engine tests.", " you", " x"], 0),
    ("Prefill", [" chunks", " and decode", " steps with continuous batching"], 1),
    ("Latency honest:", [" p50", " p90", " p99"], 2),
    ("Jumps over the ", ["lazy dog", "fence", "quick brown fox again"], 0),
    ("Fixed-size", [" blocks", " pages", " chunks of memory for keys"], 0),
    ("A B C", [" D", " E F G H", " Z"], 0),
    ("one two", [" three", " four five six seven", " 3"], 0),
    ("This is a", [" test.", " tiny tokenizer", " fox"], 1),
    ("Mixes prefill", [" chunks with decode steps.", " and", " water"], 0),
    ("Over the lazy dog the quick", [" brown fox", " red fox", " fox"], 0),
]


def write_task(directory, cases: list[dict]) -> None:
    """The cases as lm-eval's multiple_choice task over a local JSONL (the `json` builder)."""
    data = directory / "cases.jsonl"
    data.write_text("".join(json.dumps(case) + "\n" for case in cases))
    # target_delimiter "": the continuations are the choices verbatim, as ours are.
    (directory / f"{TASK}.yaml").write_text(textwrap.dedent(f"""\
        task: {TASK}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
          cache_dir: {directory / "datasets-cache"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: prompt
        doc_to_choice: choices
        doc_to_target: answer
        target_delimiter: ""
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
          - metric: acc_norm
            aggregation: mean
            higher_is_better: true
        """))


def lm_eval_scores(replica, checkpoint_dir, task_dir) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{replica.base_url}/v1/completions",
                    "tokenizer": str(checkpoint_dir), "tokenizer_backend": "huggingface",
                    "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir),
                                               include_defaults=False),
        num_fewshot=0, batch_size=1, log_samples=True, bootstrap_iters=0)


def our_outcomes(replica, cases: list[dict]):
    async def run():
        client = ReplicaClient(replica.base_url, MODEL, priority=-1000)
        try:
            return [await score_case(client, case, index) for index, case in enumerate(cases)]
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_choice_scores_equal_lm_evaluation_harness(replica, tiny_llama_dir, tmp_path,
                                                   monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cases = [{"id": f"c{i}", "scorer": "choice", "prompt": prompt, "choices": choices,
              "answer": answer} for i, (prompt, choices, answer) in enumerate(CASES)]
    assert all(c.isascii() for case in cases for c in case["choices"])  # bytes == characters
    write_task(tmp_path, cases)

    theirs = lm_eval_scores(replica, tiny_llama_dir, tmp_path)
    outcomes = our_outcomes(replica, cases)
    scores, _ = summarise(outcomes)

    metrics = theirs["results"][TASK]
    assert scores["choice"]["acc"] == pytest.approx(metrics["acc,none"], abs=1e-12)
    assert scores["choice"]["acc_norm"] == pytest.approx(metrics["acc_norm,none"], abs=1e-12)
    samples = sorted(theirs["samples"][TASK], key=lambda s: s["doc_id"])
    assert len(samples) == len(outcomes) == len(CASES)
    for sample, outcome in zip(samples, outcomes, strict=True):
        their_lls = [ll for ll, _is_greedy in (r[0] for r in sample["resps"])]
        assert outcome.detail["loglikelihoods"] == pytest.approx(their_lls, abs=1e-4), \
            outcome.case_id
        assert outcome.detail["acc"] == bool(sample["acc"])
        assert outcome.detail["acc_norm"] == bool(sample["acc_norm"])
    # The cases tell acc from acc_norm apart, or the comparison proves less than it says.
    assert any(o.detail["chosen"] != o.detail["chosen_norm"] for o in outcomes)
    assert 0 < scores["choice"]["passed"] < len(CASES)
