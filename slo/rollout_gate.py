"""The SLO module's side of a rollout (deployments/rollout_gate.py): budgets that block a rollout,
the analysis that compares the candidate's track with stable's on the same SLIs, and the watch
after success that compares the new version with the previous one the same way.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.db import connection
from django.db.models import Q

from deployments.choices import Verdict
from deployments.models import Deployment, Rollout
from deployments.rollout_gate import CANDIDATE_REPLICA_SQL, Measurement, candidate_params
from slo.choices import Scope, SliKind, SloState
from slo.models import Slo
from slo.sli import REQUEST_GOOD_SQL, REQUEST_TOTAL_SQL, SERVER_FAILURE_SQL

# Without an SLO on the deployment, analysis judges availability against this objective.
IMPLIED_OBJECTIVE = 0.99
# Both tracks burning: the candidate is blamed only when it burns this much more than stable.
BOTH_BURNING_RATIO = 1.2
# The watch reads the previous version's figures from at most this much of the rollout's span.
WATCH_BASELINE_MAX = timedelta(hours=1)


def _spent_budgets(deployment: Deployment):
    return Slo.objects.filter(
        Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id),
        status__budget_remaining__lte=0,
    )


def exhausted_slos(deployment: Deployment) -> list[tuple[str, float]]:
    """(SLO name, budget remaining) of every SLO on this deployment whose error budget is spent,
    except those whose last evaluation found too few events to judge (state 'insufficient'): two
    slow requests on a new SLO are no reason to refuse every rollout, the fix included.
    `insufficient_traffic_slos` names those the gate let through, for its message."""
    judged = _spent_budgets(deployment).exclude(status__state=SloState.INSUFFICIENT)
    return sorted(judged.values_list("name", "status__budget_remaining"))


def insufficient_traffic_slos(deployment: Deployment) -> list[tuple[str, int, int]]:
    """(SLO name, events in its window, events needed) of the SLOs whose budget reads spent but
    which the gate does not refuse on, because their window held too few events."""
    passed_over = _spent_budgets(deployment).filter(status__state=SloState.INSUFFICIENT)
    return sorted(passed_over.values_list("name", "status__total", "min_requests"))


# Events of one deployment in a window, each labelled with the track that served it.
_TRACKED_EVENTS = f"""
    SELECT e.*, CASE WHEN {CANDIDATE_REPLICA_SQL} THEN 'candidate' ELSE 'stable' END AS track
    FROM tenants_usageevent e JOIN runtime_replica r ON r.id = e.replica
    WHERE e.deployment = %(deployment)s AND e.time >= %(start)s AND e.time < %(end)s
"""
_TRACK_STATS = f"""
    SELECT e.track, count(*), count(*) FILTER (WHERE {SERVER_FAILURE_SQL}),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY e.ttft_ms) FILTER (WHERE NOT {SERVER_FAILURE_SQL}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.ttft_ms) FILTER (WHERE NOT {SERVER_FAILURE_SQL}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.tpot_ms) FILTER (WHERE NOT {SERVER_FAILURE_SQL}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.e2e_ms) FILTER (WHERE NOT {SERVER_FAILURE_SQL})
    FROM ({_TRACKED_EVENTS}) e GROUP BY e.track
"""
# Attempts a replica failed before the gateway retried the request elsewhere (the client never
# saw them): bad events of the track that failed them.
_FAILED_ATTEMPTS = f"""
    SELECT CASE WHEN {CANDIDATE_REPLICA_SQL} THEN 'candidate' ELSE 'stable' END, count(*)
    FROM tenants_usageevent e JOIN runtime_replica r ON r.id = e.failed_replica
    WHERE e.deployment = %(deployment)s AND e.time >= %(start)s AND e.time < %(end)s GROUP BY 1
"""
_SLO_COUNTS = f"""
    SELECT s.id, e.track, count(*) FILTER (WHERE {REQUEST_TOTAL_SQL}),
           count(*) FILTER (WHERE ({REQUEST_TOTAL_SQL}) AND ({REQUEST_GOOD_SQL}))
    FROM slo_slo s JOIN ({_TRACKED_EVENTS}) e ON (s.scope <> '{Scope.TENANT}' OR e.tenant = s.tenant)
    WHERE s.id = ANY(%(slos)s) GROUP BY 1, 2
"""
_PERCENTILES = ("ttft_p50_ms", "ttft_p95_ms", "tpot_p95_ms", "e2e_p95_ms")
RATIO_CHECKS = {"ttft_p95_ratio": "ttft_p95_ms", "tpot_p95_ratio": "tpot_p95_ms", "e2e_p95_ratio": "e2e_p95_ms"}


def _empty_track() -> dict:
    return {"requests": 0, "failures": 0, "failed_attempts": 0, **dict.fromkeys(_PERCENTILES), "slos": {}}


def _track_stats(rollout: Rollout, slos: list[Slo], start: datetime, end: datetime) -> dict[str, dict]:
    params = {**candidate_params(rollout), "deployment": rollout.deployment.name, "start": start, "end": end,
              "slos": [slo.pk for slo in slos]}
    tracks = {"candidate": _empty_track(), "stable": _empty_track()}
    with connection.cursor() as cursor:
        cursor.execute(_TRACK_STATS, params)
        for track, requests, failures, *percentiles in cursor.fetchall():
            rounded = {k: None if v is None else round(v, 2) for k, v in zip(_PERCENTILES, percentiles, strict=True)}
            tracks[track].update(requests=requests, failures=failures, **rounded)
        cursor.execute(_FAILED_ATTEMPTS, params)
        for track, count in cursor.fetchall():
            tracks[track]["failed_attempts"] = count
        counts: dict[tuple[int, str], tuple[int, int]] = {}
        if slos:
            cursor.execute(_SLO_COUNTS, params)
            counts = {(slo_id, track): (total, good) for slo_id, track, total, good in cursor.fetchall()}
    for track, stats in tracks.items():
        attempts = stats["requests"] + stats["failed_attempts"]
        stats["error_rate"] = (stats["failures"] + stats["failed_attempts"]) / attempts if attempts else None
        for slo in slos or [None]:
            if slo is None:  # no SLO: judged on availability against the implied objective
                name, objective, total, good = "availability (implied)", IMPLIED_OBJECTIVE, attempts, (
                    attempts - stats["failures"] - stats["failed_attempts"])
            else:
                name, objective = slo.name, slo.objective
                total, good = counts.get((slo.pk, track), (0, 0))
                if slo.sli_kind != SliKind.LATENCY:  # a failed attempt is a server failure
                    total += stats["failed_attempts"]
            burn = (1 - good / total) / (1 - objective) if total else None
            stats["slos"][name] = {"good": good, "total": total, "objective": objective,
                                   "burn_rate": round(burn, 3) if burn is not None else None}
    return tracks


def _judged_slos(deployment: Deployment) -> list[Slo]:
    return list(Slo.objects.filter(Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id))
                .exclude(sli_kind=SliKind.RATIO).order_by("name"))


def _baseline(rollout: Rollout, slos: list[Slo], stable: dict, start: datetime, end: datetime, min_requests: int,
              label: str) -> dict:
    """Stable's figures over [start, end), or over the same length just before when those are too few
    (blue-green after the switch, a short rollout)."""
    if stable["requests"] >= min_requests:
        return stable
    before = _track_stats(rollout, slos, start - (end - start), start)["stable"]
    return {**before, "baseline": label} if before["requests"] > stable["requests"] else stable


def _burn_checks(candidate: dict, stable: dict, limit: float, blame_ratio: float) -> list[dict]:
    """One check per SLO: the candidate's burn rate against `limit`. When stable burns above the limit
    too, the candidate is blamed only when it burns more than `blame_ratio` times stable (else not judged)."""
    checks = []
    for name, figures in candidate["slos"].items():
        burn = figures["burn_rate"]
        stable_burn = stable["slos"].get(name, {}).get("burn_rate")
        ok = burn is None or burn <= limit
        if not ok and stable_burn is not None and stable_burn > limit and burn <= stable_burn * blame_ratio:
            ok = None  # both burn alike: not the candidate's doing
        checks.append({"name": f"{name} burn rate", "candidate": burn, "stable": stable_burn, "limit": limit,
                       "ok": ok})
    return checks


def measure(rollout: Rollout, config: dict, start: datetime, end: datetime, *, final: bool) -> Measurement:
    """Candidate vs stable over [start, end): burn rate per SLO, optional thresholds, a verdict.

    The stable baseline is the same window, or — when stable served too little of it (blue-green
    after the switch) — the window of the same length before the step.
    """
    slos = _judged_slos(rollout.deployment)
    tracks = _track_stats(rollout, slos, start, end)
    candidate = tracks["candidate"]
    min_requests = config["min_requests"]
    stable = _baseline(rollout, slos, tracks["stable"], start, end, min_requests, "the window before this step")
    candidate_n = candidate["requests"] + candidate["failed_attempts"]
    checks = _burn_checks(candidate, stable, config["max_burn_rate"], BOTH_BURNING_RATIO)
    for name, limit in config["thresholds"].items():
        if name == "error_rate_max":
            value = candidate["error_rate"]
            checks.append({"name": "error rate", "candidate": value, "stable": stable["error_rate"], "limit": limit,
                           "ok": value is None or value <= limit})
            continue
        field = RATIO_CHECKS[name]
        value, base = candidate[field], stable[field]
        bound = base * limit if base is not None else None
        checks.append({"name": f"{field.removesuffix('_ms').replace('_', ' ')} ≤ {limit:g}× stable",
                       "candidate": value, "stable": base, "limit": round(bound, 2) if bound is not None else None,
                       "ok": None if value is None or bound is None else value <= bound})
    failed = [c for c in checks if c["ok"] is False]
    unsure = [c for c in checks if c["ok"] is None and c["candidate"] is not None]
    seconds = (end - start).total_seconds()
    if candidate_n < min_requests:
        reason = f"{candidate_n} candidate requests in {seconds:.0f}s; judging needs {min_requests}."
        verdict = Verdict.INCONCLUSIVE if final else Verdict.RUNNING
    elif failed:
        verdict, reason = Verdict.FAIL, "; ".join(_describe(c) for c in failed)
    elif unsure and final:
        verdict = Verdict.INCONCLUSIVE
        reason = "; ".join(_describe(c) for c in unsure) + " (not judged: no stable baseline, or stable burns as much)"
    else:
        verdict = Verdict.PASS if final else Verdict.RUNNING
        reason = f"{candidate_n} candidate requests in {seconds:.0f}s; every check within its limit."
    return Measurement(verdict, candidate, stable, checks, reason)


def watch(rollout: Rollout, limits: dict, end: datetime) -> Measurement:
    """The new version since the rollout finished against the previous one: FAIL when it burns an SLO
    above the limit while the previous version did not, else RUNNING.

    The previous version is measured over the rollout's own span (it served beside the candidate
    there; the last hour of it at most), or the same length before the rollout when that span has
    too few of its requests.
    """
    slos = _judged_slos(rollout.deployment)
    start = rollout.finished_at
    span_start = max(rollout.created_at, start - WATCH_BASELINE_MAX)
    new = _track_stats(rollout, slos, start, end)["candidate"]
    previous = _baseline(rollout, slos, _track_stats(rollout, slos, span_start, start)["stable"], span_start, start,
                         limits["min_requests"], "the same length before the rollout")
    # A previous version that burned above the limit too is never blamed on the new one.
    checks = _burn_checks(new, previous, limits["max_burn_rate"], math.inf)
    failed = [c for c in checks if c["ok"] is False]
    new_n = new["requests"] + new["failed_attempts"]
    since = f"{new_n} requests on the new version since it took all traffic"
    if new_n < limits["min_requests"]:
        verdict, reason = Verdict.RUNNING, f"{since}; judging needs {limits['min_requests']}."
    elif failed:
        verdict = Verdict.FAIL
        reason = ("the new version burns an SLO the previous one did not: "
                  + "; ".join(_describe(c, "new", "previous") for c in failed))
    else:
        verdict, reason = Verdict.RUNNING, f"{since}; every SLO within its limit."
    return Measurement(verdict, new, previous, checks, reason)


def _describe(check: dict, candidate: str = "candidate", stable: str = "stable") -> str:
    return f"{check['name']}: {candidate} {check['candidate']}, {stable} {check['stable']}, limit {check['limit']}"


class SloRolloutGate:
    server_failure_sql = SERVER_FAILURE_SQL
    exhausted_slos = staticmethod(exhausted_slos)
    insufficient_traffic_slos = staticmethod(insufficient_traffic_slos)
    measure = staticmethod(measure)
    watch = staticmethod(watch)
