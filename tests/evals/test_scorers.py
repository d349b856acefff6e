"""The scorers: their judgements and a run's figures on hand-made outputs (pure), then every
scorer end to end on a real replica of the tiny checkpoint."""

from __future__ import annotations

import asyncio
import re

import pytest

from evals.scoring.client import Generation, ReplicaClient
from evals.scoring.scorers import (
    CaseOutcome,
    judge_choice,
    judge_exact,
    judge_parity,
    judge_regex,
    judge_similarity,
    score_case,
    summarise,
)
from tests.evals.replica import MODEL


def test_exact_compares_trimmed_text():
    assert judge_exact("  Paris\n", "Paris")[:2] == (True, "")
    assert judge_exact("Paris", "Paris ")[0]
    passed, reason, detail = judge_exact(" Lyon", "Paris")
    assert not passed and reason == "expected 'Paris', got 'Lyon'"
    assert detail == {"expected": "Paris"}
    assert not judge_exact("paris", "Paris")[0]  # case matters


def test_exact_quotes_long_outputs_short():
    reason = judge_exact("x" * 500, "y")[1]
    assert reason.endswith("…'") and len(reason) < 200


def test_regex_searches_anywhere_unless_anchored():
    assert judge_regex("The answer is 42.", r"\b42\b")[0]
    assert judge_regex("  42 \n", r"^42$")[0]  # on the trimmed output
    passed, reason, _ = judge_regex("The answer is 42.", r"^42$")
    assert not passed and reason == "no match for '^42$' in 'The answer is 42.'"
    assert judge_regex("abc", "b")[2] == {"pattern": "b", "match": "b"}


def test_a_broken_pattern_fails_the_case_saying_why():
    passed, reason, _ = judge_regex("abc", "(")
    assert not passed and "not a valid regular expression" in reason


def test_choice_acc_and_acc_norm_as_lm_eval_defines_them():
    choices = [" a", " bbbbbbbb"]
    # Summed: " a" wins (-2 > -4); per byte: " bbbbbbbb" wins (-4/9 > -2/2).
    passed, reason, detail = judge_choice([-2.0, -4.0], choices, answer=1)
    assert not passed and detail["chosen"] == 0 and detail["chosen_norm"] == 1
    assert detail["acc"] is False and detail["acc_norm"] is True
    assert reason == "chose 0 (' a'), answer 1 (' bbbbbbbb')"
    passed, reason, detail = judge_choice([-2.0, -4.0], choices, answer=0)
    assert passed and reason == "" and detail["acc_norm"] is False


def test_choice_normalises_by_utf8_bytes_not_characters():
    # "é" is 2 bytes: -3/2 = -1.5 beats "x"'s -2/1 only when counted in bytes.
    detail = judge_choice([-3.0, -2.0], ["é", "x"], answer=0)[2]
    assert detail["chosen"] == 1 and detail["chosen_norm"] == 0


def test_choice_ties_go_to_the_first_as_argmax_does():
    assert judge_choice([-1.0, -1.0, -3.0], ["x", "y", "z"], answer=0)[2]["chosen"] == 0


def test_similarity_passes_at_the_threshold_and_clips_its_score():
    assert judge_similarity(0.8, 0.8)[:3] == (0.8, True, "")
    score, passed, reason, detail = judge_similarity(0.62, 0.8)
    assert (score, passed) == (0.62, False)
    assert reason == "similarity 0.620 is under the threshold 0.8"
    assert judge_similarity(-0.1, 0.5)[0] == 0.0 and judge_similarity(1.0000002, 1)[0] == 1.0
    assert detail == {"similarity": 0.62, "threshold": 0.8}


@pytest.mark.parametrize("tokens, reference, agreement, divergence", [
    (["a", "b", "c"], ["a", "b", "c"], 1.0, None),
    (["a", "x", "c"], ["a", "b", "c"], 2 / 3, 1),
    (["a", "b"], ["a", "b", "c", "d"], 2 / 4, 2),  # stopped early: the end diverges
    (["a", "b", "c"], ["a"], 1 / 3, 1),
    (["x"], ["y"], 0.0, 0),
    ([], [], 1.0, None),
    ([], ["a"], 0.0, 0),
])
def test_parity_agreement_over_the_longer_length(tokens, reference, agreement, divergence):
    score, passed, _, detail = judge_parity(tokens, reference)
    assert score == pytest.approx(agreement) and detail["token_agreement"] == score
    assert detail["first_divergence"] == divergence and passed == (divergence is None)


def test_parity_reasons_name_the_tokens():
    assert judge_parity([" the", " cat"], [" the", " a"])[2] == \
        "diverged at token 1: ' cat' vs the reference's ' a'"
    assert judge_parity([" the"], [" the", " a"])[2] == \
        "diverged at token 1: the end vs the reference's ' a'"
    assert judge_parity(["x"], ["x"])[2] == ""


def outcome(scorer: str, passed: bool, **detail) -> CaseOutcome:
    return CaseOutcome("c", 0, scorer, "", float(passed), passed, "", detail)


def test_summarise_per_scorer_and_overall():
    outcomes = [
        outcome("exact", True), outcome("exact", False), outcome("regex", True),
        outcome("choice", True, acc=True, acc_norm=False),
        outcome("choice", False, acc=False, acc_norm=True),
        outcome("choice", False, acc=False, acc_norm=True),
        outcome("similarity", True, similarity=0.9), outcome("similarity", False, similarity=0.5),
        outcome("parity", True, token_agreement=1.0, first_divergence=None),
        outcome("parity", False, token_agreement=0.5, first_divergence=3),
    ]
    scores, score = summarise(outcomes)
    assert score == 5 / 10
    assert scores["exact"] == {"cases": 2, "passed": 1, "score": 0.5}
    assert scores["regex"] == {"cases": 1, "passed": 1, "score": 1.0}
    assert scores["choice"] == {"cases": 3, "passed": 1, "score": 1 / 3,
                                "acc": 1 / 3, "acc_norm": 2 / 3}
    assert scores["similarity"] == {"cases": 2, "passed": 1, "score": 0.5,
                                    "mean_similarity": pytest.approx(0.7)}
    assert scores["parity"] == {"cases": 2, "passed": 1, "score": 0.5,
                                "token_agreement": 0.75, "identical": 1}


def test_summarise_nothing():
    assert summarise([]) == ({}, 0.0)


def test_a_case_the_replica_refused_counts_as_failed_everywhere():
    refused = CaseOutcome("c", 0, "choice", "", 0.0, False, "the replica refused the case: …")
    scores, score = summarise([refused, outcome("choice", True, acc=True, acc_norm=True)])
    assert scores["choice"]["acc"] == 0.5 and score == 0.5


# -- every scorer on a real replica of the tiny checkpoint -----------------------------------

def scored(replica, case: dict, index: int = 0, **kwargs) -> CaseOutcome:
    async def run():
        client = ReplicaClient(replica.base_url, MODEL, priority=-1000)
        try:
            return await score_case(client, case, index, **kwargs)
        finally:
            await client.aclose()

    return asyncio.run(run())


def greedy(replica, case: dict) -> Generation:
    async def run():
        client = ReplicaClient(replica.base_url, MODEL, priority=None)
        try:
            return await client.greedy(case)
        finally:
            await client.aclose()

    return asyncio.run(run())


async def loglikelihoods(replica, context, choices):
    client = ReplicaClient(replica.base_url, MODEL, priority=None)
    try:
        return await client.loglikelihoods(context, choices)
    finally:
        await client.aclose()


PROMPT = {"prompt": "The quick brown", "max_tokens": 6}


def test_exact_on_a_replica(replica):
    text = greedy(replica, PROMPT).text
    outcome = scored(replica, {"id": "e1", "scorer": "exact", **PROMPT, "expected": text}, 3)
    assert (outcome.case_id, outcome.index, outcome.scorer) == ("e1", 3, "exact")
    assert outcome.passed and outcome.score == 1.0 and outcome.output == text
    assert outcome.completion_tokens == 6 and outcome.prompt_tokens > 0
    assert outcome.latency_ms > 0
    missed = scored(replica, {"id": "e2", "scorer": "exact", **PROMPT, "expected": "Paris"})
    assert not missed.passed and missed.score == 0.0
    assert missed.reason == f"expected 'Paris', got {text.strip()!r}"


def test_regex_on_a_replica(replica):
    text = greedy(replica, PROMPT).text.strip()
    case = {"id": "r", "scorer": "regex", **PROMPT, "expected": re.escape(text[1:4])}
    assert scored(replica, case).passed
    assert not scored(replica, {**case, "expected": "^Paris$"}).passed


def test_choice_on_a_replica(replica):
    choices = [" brown", " lazy dog", " fox"]
    lls = asyncio.run(loglikelihoods(replica, "The quick", choices))
    best = max(range(3), key=lls.__getitem__)
    case = {"id": "ch", "scorer": "choice", "prompt": "The quick", "choices": choices,
            "answer": best}
    outcome = scored(replica, case)
    assert outcome.passed and outcome.output == choices[best]
    assert outcome.detail["loglikelihoods"] == pytest.approx(lls, abs=1e-6)
    assert outcome.detail["chosen"] == best and outcome.detail["acc"] is True
    # One echo request per choice: each generates one token, dropped.
    assert outcome.completion_tokens == 3 and outcome.prompt_tokens > 0
    wrong = (best + 1) % 3
    missed = scored(replica, {**case, "answer": wrong})
    assert not missed.passed and missed.score == 0.0
    assert missed.reason == f"chose {best} ({choices[best]!r}), answer {wrong} ({choices[wrong]!r})"


def test_choice_on_a_chat_case(replica):
    case = {"id": "cc", "scorer": "choice", "messages": [{"role": "user", "content": "Hi"}],
            "choices": [" yes", " no"], "answer": 0}
    outcome = scored(replica, case)
    assert len(outcome.detail["loglikelihoods"]) == 2 and outcome.output in case["choices"]


def test_similarity_on_a_replica(replica):
    text = greedy(replica, PROMPT).text
    case = {"id": "s", "scorer": "similarity", **PROMPT, "reference": text}
    same = scored(replica, case)  # the output against itself: the same embedding
    assert same.passed and same.score == pytest.approx(1.0, abs=1e-4)
    assert same.detail["threshold"] == 0.8
    other = scored(replica, {**case, "reference": "A recipe for lemon cake with almonds.",
                             "threshold": 0.99})
    assert not other.passed and other.score < 0.99
    assert other.reason.startswith("similarity ") and "under the threshold 0.99" in other.reason


def test_parity_on_a_replica(replica):
    reference = greedy(replica, PROMPT)
    case = {"id": "p", "scorer": "parity", **PROMPT}
    same = scored(replica, case, reference=reference)
    assert same.passed and same.score == 1.0 and same.reason == ""
    assert same.detail["first_divergence"] is None and same.detail["reference"] == reference.text
    # The reference version answered something else: where they part is named.
    elsewhere = greedy(replica, {"prompt": "Hello world!", "max_tokens": 6})
    assert elsewhere.tokens != reference.tokens
    differs = scored(replica, case, reference=elsewhere)
    divergence = differs.detail["first_divergence"]
    assert not differs.passed and differs.score < 1.0
    assert differs.reason.startswith(f"diverged at token {divergence}: ")
    with pytest.raises(ValueError, match="reference"):
        scored(replica, case)


def test_a_case_the_replica_refuses_fails_with_its_words(replica):
    outcome = scored(replica, {"id": "long", "scorer": "exact", "prompt": "x",
                               "max_tokens": 10_000, "expected": "y"})
    assert not outcome.passed and outcome.score == 0.0
    assert outcome.reason.startswith("the replica refused the case: ")
    assert "maximum context length" in outcome.reason
