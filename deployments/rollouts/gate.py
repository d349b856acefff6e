"""What a rollout asks of the SLOs: is an error budget spent, and how does the candidate compare
with stable (during analysis, and during the watch after success).

SLOs are defined on deployments (slo imports deployments), so deployments never imports slo: the
SLO module implements this interface (slo/rollout_gate.py) and registers it when Django starts
(SloConfig.ready). Rollout actions and the state machine call it through `gate()`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from deployments.choices import Verdict

# SQL over a replica row `r`: true when it serves the rollout's candidate spec, i.e. the rollout
# started it, or the deployment started one of that spec after the rollout made it the stable one
# (a replacement during the watch). Parameters from candidate_params().
CANDIDATE_REPLICA_SQL = ("(r.rollout_id = %(rollout)s OR (r.version_id = %(candidate_version)s "
                         "AND r.engine_args = %(candidate_engine_args)s::jsonb))")


def candidate_params(rollout) -> dict:
    return {"rollout": rollout.pk, "candidate_version": rollout.candidate_version_id,
            "candidate_engine_args": json.dumps(rollout.candidate_engine_args)}


@dataclass(frozen=True)
class Measurement:
    """One look at the analysis window: per-track figures, the checks made, and a verdict."""

    verdict: str  # deployments.choices.Verdict
    candidate: dict
    stable: dict
    checks: list
    reason: str


class RolloutGate(Protocol):
    # SQL over a usage event row `e`: true when the request failed through the server's fault.
    server_failure_sql: str

    def exhausted_slos(self, deployment) -> list[tuple[str, float]]:
        """(SLO name, budget remaining) of every SLO covering the deployment whose budget is spent."""

    def measure(self, rollout, config: dict, start: datetime, end: datetime, *, final: bool) -> Measurement:
        """Candidate against stable over [start, end), judged by the step's analysis config."""

    def watch(self, rollout, limits: dict, end: datetime) -> Measurement:
        """The new version since the rollout finished (until `end`) against the previous one: FAIL when
        it burns an SLO above limits["max_burn_rate"] over at least limits["min_requests"] requests while
        the previous version, at a comparable load, did not, else RUNNING. A failing check has ok False
        only then, and `basis` "same time" when the previous version failed less beside it (its holdback)
        or "before" when judged against its past: the watch asks such a failure to persist."""


def min_events(check_kind: str, config: dict, limit: float, objective: float | None = None) -> int:
    """Events a check needs before it may fail a step: the step's `min_events` when set, else enough
    that one bad event alone stays within the limit (50 at a 0.99 objective and 2x), at least `min_requests`."""
    if config.get("min_events") is not None:
        return config["min_events"]
    floor = config["min_requests"]
    if check_kind == "burn" and objective is not None and objective < 1 and limit:
        return max(floor, math.ceil(round(1 / ((1 - objective) * limit), 6)))
    if check_kind == "error_rate" and limit:
        return max(floor, math.ceil(round(1 / limit, 6)))
    return floor


def _check_events(check: dict, candidate: dict, config: dict) -> tuple[int, int, bool]:
    """(events so far, events needed, whether the failure is certain already: it would stand even if
    every event still missing came in good; a percentile ratio never is)."""
    attempts = (candidate.get("requests") or 0) + (candidate.get("failed_attempts") or 0)
    limit = check.get("limit") or 0
    for slo, figures in candidate.get("slos", {}).items():
        if check["name"] == f"{slo} burn rate":
            total, bad, objective = figures["total"], figures["total"] - figures["good"], figures["objective"]
            needed = min_events("burn", config, limit, objective)
            certain = objective < 1 and bad / (max(total, needed) * (1 - objective)) > limit
            return total, needed, certain
    if check["name"] == "error rate":
        bad = (candidate.get("failures") or 0) + (candidate.get("failed_attempts") or 0)
        needed = min_events("error_rate", config, limit)
        return attempts, needed, bad / max(attempts, needed, 1) > limit
    return attempts, min_events("ratio", config, limit), False


def not_enough_text(events: int, needed: int) -> str:
    return f"{events} of {needed} requests: not enough to judge yet"


def low_traffic_guard(result: Measurement, config: dict, *, final: bool) -> Measurement:
    """The gate's measurement with every failing check on fewer events than it needs held back (not
    judged, with a note), unless the failure is certain already: one slow request of 20 at a 0.99
    objective reads as a 5x burn, which says nothing yet. Held back by the window's end: inconclusive."""
    checks, held = [], []
    for check in result.checks:
        events, needed, certain = _check_events(check, result.candidate, config)
        check = {**check, "events": events, "min_events": needed}
        if check.get("ok") is False and events < needed and not certain:
            check.update(ok=None, note=not_enough_text(events, needed))
            held.append(check)
        checks.append(check)
    if result.verdict != Verdict.FAIL or not held:
        return replace(result, checks=checks)
    failed = [c for c in checks if c.get("ok") is False]
    if failed:
        reason = "; ".join(f"{c['name']}: candidate {c['candidate']}, stable {c['stable']}, limit {c['limit']}"
                           for c in failed)
        return replace(result, checks=checks, reason=reason)
    reason = "; ".join(f"{c['name']}: {c['note']}" for c in held) + "."
    return replace(result, verdict=Verdict.INCONCLUSIVE if final else Verdict.RUNNING, checks=checks, reason=reason)


_registered: RolloutGate | None = None


def register(implementation: RolloutGate) -> None:
    global _registered
    _registered = implementation


def gate() -> RolloutGate:
    if _registered is None:
        raise RuntimeError("No rollout gate registered: the slo app registers one when Django starts "
                           "(is 'slo' in INSTALLED_APPS?).")
    return _registered
