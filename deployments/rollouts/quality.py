"""What a rollout asks of the eval sets: is this eval set there, score the candidate, and has it
scored as well as the stable version.

Eval runs belong to the evals app, which sits above deployments (evals imports deployments), so
deployments never imports evals: evals implements this interface (evals/rollout_quality.py) and
registers it when Django starts (EvalsConfig.ready). The spec check at creation and the state
machine's quality step call it through `quality()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from deployments.choices import Verdict

# Scores are fractions of cases passed: a drop equal to the limit, give or take float noise, passes.
SCORE_DECIMALS = 6


@dataclass(frozen=True)
class QualityVerdict:
    """One look at a quality step: RUNNING until its runs finish, then PASS or FAIL (INCONCLUSIVE when a run
    failed or was cancelled: no score to judge by), with the figures behind it."""

    verdict: str  # deployments.choices.Verdict
    reason: str
    link: str = ""  # failing cases of the candidate's run, once it has finished
    candidate: dict = field(default_factory=dict)  # {"run", "score", "done", "total", "status", "url"}
    stable: dict = field(default_factory=dict)  # {"run" | None, "score", "basis", "url"}
    checks: list = field(default_factory=list)  # [{name, candidate, stable, limit, ok}] as analysis has


class RolloutQuality(Protocol):
    def validate(self, config: dict) -> list[str]:
        """What is wrong with a normalised quality step for this installation (an eval set or version that
        does not exist), one message per field, each starting with the field's name ("eval_set: ...")."""

    def start(self, rollout, config: dict) -> dict:
        """Start scoring the candidate (and the stable version when it has no score to compare with);
        the state to keep on the rollout for `verdict` and `stop`: run ids, set version, stable basis."""

    def verdict(self, rollout, config: dict, state: dict) -> QualityVerdict:
        """Where the runs of `state` stand, judged by the step's limits."""

    def stop(self, state: dict) -> None:
        """Cancel the runs of `state` that have not finished (the step ended without them)."""


def judge(config: dict, candidate: float, stable: float | None) -> tuple[str, list, str]:
    """(verdict, checks, reason) for a candidate score against the stable one, by the step's `min_score`
    and `max_drop`: FAIL when the candidate is under the floor or lost more than `max_drop`. Without the
    stable score (not known yet) the drop is not judged: only the floor can fail."""
    name = config["eval_set"]
    drop = None if stable is None else round(stable - candidate, SCORE_DECIMALS)
    checks, failures = [], []
    if config.get("min_score") is not None:
        ok = round(candidate, SCORE_DECIMALS) >= config["min_score"]
        checks.append({"name": f"{name} score", "candidate": candidate, "stable": stable,
                       "limit": config["min_score"], "ok": ok})
        if not ok:
            failures.append(f"under the floor {config['min_score']:.2f}")
    if config.get("max_drop") is not None:
        ok = None if drop is None else drop <= config["max_drop"]
        checks.append({"name": f"{name} drop", "candidate": drop, "stable": None, "limit": config["max_drop"],
                       "ok": ok})
        if ok is False:
            failures.append(f"a drop of {drop:.2f} over the limit {config['max_drop']:.2f}")
    figures = (f"candidate {candidate:.2f}" if stable is None
               else f"candidate {candidate:.2f}, stable {stable:.2f} (drop {drop:.2f})")
    if failures:
        return Verdict.FAIL, checks, f"quality {name}: {figures}: {' and '.join(failures)}"
    return Verdict.PASS, checks, f"quality {name}: {figures}, within {limits_text(config)}"


def limits_text(config: dict) -> str:
    """"max drop 0.05, min 0.80": the limits a quality step sets."""
    parts = []
    if config.get("max_drop") is not None:
        parts.append(f"max drop {config['max_drop']:.2f}")
    if config.get("min_score") is not None:
        parts.append(f"min {config['min_score']:.2f}")
    return ", ".join(parts)


def state_key(rollout) -> str:
    """Where a quality step keeps its runs on the rollout row: one entry per attempt and step."""
    return f"{rollout.attempt}.{rollout.step_index}"


def quality_looks(rollout) -> list[dict]:
    """The quality steps' entries on the row, oldest attempt and step first, flattened for readers."""
    looks = sorted(rollout.quality.values(), key=lambda entry: (entry["attempt"], entry["step_index"]))
    return [{"attempt": entry["attempt"], "step_index": entry["step_index"], "eval_set": entry["eval_set"],
             "set_version": entry["state"].get("set_version"), "runs": entry["state"].get("runs", {}),
             "verdict": entry.get("verdict"), "reason": entry.get("reason", ""), "link": entry.get("link", ""),
             "candidate": entry.get("candidate", {}), "stable": entry.get("stable", {})} for entry in looks]


_registered: RolloutQuality | None = None


def register(implementation: RolloutQuality) -> None:
    global _registered
    _registered = implementation


def quality() -> RolloutQuality:
    if _registered is None:
        raise RuntimeError("No rollout quality implementation registered: the evals app registers one when "
                           "Django starts (is 'evals' in INSTALLED_APPS?).")
    return _registered
