"""Scoring one case against a replica, and a run's figures from its cases' outcomes.

A case passes or fails and scores in [0, 1]:
- `exact`: the greedy output, whitespace-trimmed, equals `expected` (trimmed too);
- `regex`: `re.search(expected, trimmed output)` finds a match anywhere, as eval suites'
  regex checks do; a pattern meant for the whole output anchors itself (`^...$`);
- `choice`: lm-evaluation-harness's `acc` (the most likely choice is the answer) and
  `acc_norm` (the most likely per UTF-8 byte is); the case passes on `acc`;
- `similarity`: cosine similarity of the output's and the reference's embeddings, passing at
  the case's threshold; its score is the similarity clipped to [0, 1];
- `parity`: the output's tokens against the reference version's greedy tokens; it passes when
  they are identical, and scores the token agreement.
A replica's refusal of the case itself (400: a prompt too long for its context, say) fails the
case with the replica's words; anything else the replica does wrong fails the run (it raises).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from evals.choices import Scorer
from evals.scoring.client import Generation, ReplicaClient, ReplicaError
from evals.scoring.similarity import cosine_similarity

DEFAULT_THRESHOLD = 0.8
SHOWN_CHARS = 120  # of an output or expectation quoted in a reason


@dataclass
class CaseOutcome:
    case_id: str
    index: int
    scorer: str
    output: str
    score: float
    passed: bool
    reason: str  # why it failed, in words; empty when it passed
    detail: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0


def shown(text: str) -> str:
    """A text quoted in a reason, cut short when long."""
    if len(text) > SHOWN_CHARS:
        text = text[:SHOWN_CHARS] + "…"
    return repr(text)


async def score_case(client: ReplicaClient, case: dict, index: int, *,
                     reference: Generation | None = None) -> CaseOutcome:
    scorer = case["scorer"]
    try:
        if scorer == Scorer.CHOICE:
            return await score_choice(client, case, index)
        if scorer == Scorer.PARITY and reference is None:
            raise ValueError(f"case {case['id']}: parity needs the reference version's output")
        generation = await client.greedy(case)
    except ReplicaError as exc:
        if exc.status != 400:
            raise
        return CaseOutcome(case["id"], index, scorer, "", 0.0, False,
                           f"the replica refused the case: {exc}")
    if scorer == Scorer.EXACT:
        passed, reason, detail = judge_exact(generation.text, case["expected"])
        score = float(passed)
    elif scorer == Scorer.REGEX:
        passed, reason, detail = judge_regex(generation.text, case["expected"])
        score = float(passed)
    elif scorer == Scorer.SIMILARITY:
        threshold = case.get("threshold") or DEFAULT_THRESHOLD
        similarity = await cosine_similarity(generation.text, case["reference"])
        score, passed, reason, detail = judge_similarity(similarity, threshold)
    elif scorer == Scorer.PARITY:
        assert reference is not None
        score, passed, reason, detail = judge_parity(generation.tokens, reference.tokens)
        detail["reference"] = reference.text
    else:
        raise ValueError(f"case {case['id']}: unknown scorer {scorer!r}")
    return CaseOutcome(case["id"], index, scorer, generation.text, score, passed, reason,
                       detail, generation.prompt_tokens, generation.completion_tokens,
                       generation.latency_ms)


# -- the judgements, pure ------------------------------------------------------------------

def judge_exact(output: str, expected: str) -> tuple[bool, str, dict]:
    passed = output.strip() == expected.strip()
    reason = "" if passed else f"expected {shown(expected.strip())}, got {shown(output.strip())}"
    return passed, reason, {"expected": expected}


def judge_regex(output: str, pattern: str) -> tuple[bool, str, dict]:
    detail = {"pattern": pattern}
    try:
        match = re.search(pattern, output.strip())
    except re.error as exc:
        return False, f"the pattern {shown(pattern)} is not a valid regular expression: {exc}", \
            detail
    if match is None:
        return False, f"no match for {shown(pattern)} in {shown(output.strip())}", detail
    return True, "", {**detail, "match": match.group(0)}


def judge_choice(loglikelihoods: list[float], choices: list[str],
                 answer: int) -> tuple[bool, str, dict]:
    """lm-evaluation-harness's acc and acc_norm; the first of equal maxima wins, as its
    argmax does. Normalised by UTF-8 bytes (a choice is at least one byte long)."""
    chosen = argmax(loglikelihoods)
    chosen_norm = argmax([ll / max(len(c.encode()), 1)
                          for ll, c in zip(loglikelihoods, choices, strict=True)])
    acc, acc_norm = chosen == answer, chosen_norm == answer
    reason = "" if acc else (f"chose {chosen} ({shown(choices[chosen])}), "
                             f"answer {answer} ({shown(choices[answer])})")
    return acc, reason, {"loglikelihoods": loglikelihoods, "chosen": chosen,
                         "chosen_norm": chosen_norm, "answer": answer,
                         "acc": acc, "acc_norm": acc_norm}


def judge_similarity(similarity: float, threshold: float) -> tuple[float, bool, str, dict]:
    passed = similarity >= threshold
    reason = "" if passed else f"similarity {similarity:.3f} is under the threshold {threshold:g}"
    return min(max(similarity, 0.0), 1.0), passed, reason, \
        {"similarity": similarity, "threshold": threshold}


def judge_parity(tokens: list[str], reference: list[str]) -> tuple[float, bool, str, dict]:
    """Token agreement: the positions where both have the same token, over the longer length
    (1.0 for two empty outputs); the first divergence is the first position that differs,
    counting the end of the shorter one, None when the tokens are identical."""
    longer = max(len(tokens), len(reference))
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    agreement = same / longer if longer else 1.0
    divergence = next((i for i in range(longer)
                       if i >= len(tokens) or i >= len(reference) or tokens[i] != reference[i]),
                      None)
    reason = ""
    if divergence is not None:
        got = shown(tokens[divergence]) if divergence < len(tokens) else "the end"
        want = shown(reference[divergence]) if divergence < len(reference) else "the end"
        reason = f"diverged at token {divergence}: {got} vs the reference's {want}"
    return agreement, divergence is None, reason, {
        "token_agreement": agreement, "first_divergence": divergence,
        "tokens": len(tokens), "reference_tokens": len(reference)}


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


async def score_choice(client: ReplicaClient, case: dict, index: int) -> CaseOutcome:
    context = case["messages"] if "messages" in case else case["prompt"]
    scored = await client.score_continuations(context, case["choices"])
    passed, reason, detail = judge_choice(scored.loglikelihoods, case["choices"],
                                          case["answer"])
    output = case["choices"][detail["chosen"]]
    return CaseOutcome(case["id"], index, Scorer.CHOICE.value, output, float(passed), passed,
                       reason, detail, scored.prompt_tokens, scored.completion_tokens,
                       scored.latency_ms)


# -- a run's figures -----------------------------------------------------------------------

def summarise(outcomes: list[CaseOutcome]) -> tuple[dict, float]:
    """Per scorer {cases, passed, score} plus its own figures (choice: acc and acc_norm;
    similarity: mean_similarity; parity: mean token_agreement and the number identical), and
    the run's score: the fraction of all its cases that passed (0 for none)."""
    by_scorer: dict[str, list[CaseOutcome]] = {}
    for outcome in outcomes:
        by_scorer.setdefault(str(outcome.scorer), []).append(outcome)
    scores = {}
    for scorer, group in by_scorer.items():
        passed = sum(o.passed for o in group)
        figures: dict[str, Any] = {"cases": len(group), "passed": passed,
                                   "score": passed / len(group)}
        if scorer == Scorer.CHOICE:
            figures["acc"] = mean([o.detail.get("acc", False) for o in group])
            figures["acc_norm"] = mean([o.detail.get("acc_norm", False) for o in group])
        elif scorer == Scorer.SIMILARITY:
            figures["mean_similarity"] = mean([o.detail.get("similarity", 0.0) for o in group])
        elif scorer == Scorer.PARITY:
            figures["token_agreement"] = mean([o.detail.get("token_agreement", 0.0)
                                               for o in group])
            figures["identical"] = sum(o.detail.get("first_divergence", -1) is None
                                       for o in group)
        scores[scorer] = figures
    total_passed = sum(o.passed for o in outcomes)
    return scores, (total_passed / len(outcomes) if outcomes else 0.0)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
