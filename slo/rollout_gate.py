"""The SLO module's side of a rollout (deployments/rollouts/gate.py): budgets that block a rollout,
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
from deployments.rollouts.gate import CANDIDATE_REPLICA_SQL, Measurement, candidate_params, not_enough_text
from slo.choices import Scope, SliKind, SloState
from slo.models import Slo
from slo.sli import INTERACTIVE_SQL, REQUEST_GOOD_SQL, REQUEST_TOTAL_SQL, SERVER_FAILURE_SQL

# Without an SLO on the deployment, analysis judges availability against this objective.
IMPLIED_OBJECTIVE = 0.99
# Both tracks burning: the candidate is blamed only when it burns this much more than stable.
BOTH_BURNING_RATIO = 1.2
# The watch reads the previous version's figures from at most this much of the rollout's span.
WATCH_BASELINE_MAX = timedelta(hours=1)
# The watch compares with the held-back previous version at the same time once it served this many.
HOLDBACK_MIN_REQUESTS = 10
# ... and blames the new version only when it fails worse than that with this little chance of luck
# (one-sided Fisher exact test on bad and good events).
WORSE_P_VALUE = 0.01
# A version is blamed only at a load like its reference's: at most this many times its requests per
# replica, unless its replicas kept no queue (fewer waiting requests than QUEUE_FREE on average).
LOAD_TOLERANCE = 1.5
QUEUE_FREE = 1.0
# Without a holdback, a failure since the rollout must also show in the new version's latest requests:
# this long, or its latest `min_requests` when those go further back (as multiwindow burn alerts do).
WATCH_RECENT_S = 10.0


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
# Latency percentiles of interactive requests only: batch lines wait for idle capacity on purpose.
_LATENCY_OF = f"NOT {SERVER_FAILURE_SQL} AND {INTERACTIVE_SQL}"
_TRACK_STATS = f"""
    SELECT e.track, count(*), count(*) FILTER (WHERE {SERVER_FAILURE_SQL}),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY e.ttft_ms) FILTER (WHERE {_LATENCY_OF}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.ttft_ms) FILTER (WHERE {_LATENCY_OF}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.tpot_ms) FILTER (WHERE {_LATENCY_OF}),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY e.e2e_ms) FILTER (WHERE {_LATENCY_OF}),
           count(DISTINCT e.replica)
    FROM ({_TRACKED_EVENTS}) e GROUP BY e.track
"""
# Queue depth and running requests per replica, averaged over the minutes the scraper recorded.
_TRACK_QUEUES = f"""
    SELECT CASE WHEN {CANDIDATE_REPLICA_SQL} THEN 'candidate' ELSE 'stable' END, avg(m.waiting_avg), avg(m.running_avg)
    FROM runtime_replicametricsminute m JOIN runtime_replica r ON r.id = m.replica_id
    WHERE m.deployment_id = %(deployment_id)s AND m.start >= date_trunc('minute', %(start)s) AND m.start < %(end)s
    GROUP BY 1
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
    return {"requests": 0, "failures": 0, "failed_attempts": 0, **dict.fromkeys(_PERCENTILES), "slos": {},
            "load": {"replicas": 0, "requests_per_s_per_replica": None, "queue_depth": None, "running": None}}


def _track_stats(rollout: Rollout, slos: list[Slo], start: datetime, end: datetime) -> dict[str, dict]:
    params = {**candidate_params(rollout), "deployment": rollout.deployment.name, "start": start, "end": end,
              "slos": [slo.pk for slo in slos], "deployment_id": rollout.deployment_id}
    tracks = {"candidate": _empty_track(), "stable": _empty_track()}
    seconds = max((end - start).total_seconds(), 1e-9)
    with connection.cursor() as cursor:
        cursor.execute(_TRACK_STATS, params)
        for track, requests, failures, *percentiles, replicas in cursor.fetchall():
            rounded = {k: None if v is None else round(v, 2) for k, v in zip(_PERCENTILES, percentiles, strict=True)}
            tracks[track].update(requests=requests, failures=failures, **rounded)
            tracks[track]["load"].update(replicas=replicas,
                                         requests_per_s_per_replica=round(requests / seconds / max(replicas, 1), 3))
        cursor.execute(_TRACK_QUEUES, params)
        for track, waiting, running in cursor.fetchall():
            tracks[track]["load"].update(queue_depth=round(waiting, 2), running=round(running, 2))
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
    # Judged on each track's requests: not ratio SLIs (replica series) nor quality SLIs (eval runs, which
    # a rollout's own quality step compares).
    return list(Slo.objects.filter(Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id))
                .exclude(sli_kind__in=(SliKind.RATIO, SliKind.QUALITY)).order_by("name"))


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
    """The new version since the rollout finished (until `end`) against the previous one, like with like:
    FAIL when it burns an SLO above the limit and the previous one, at a comparable load, did not.

    At the same time first: once the previous version's held-back share has served HOLDBACK_MIN_REQUESTS,
    a new version that fails significantly more often than it is failed at once (check basis "same
    time"), and one that burns while the held-back version burns too is not blamed (a change of load
    or of the machine hits both). Otherwise (no holdback, too few requests on it, or no significant
    difference yet) the previous version's past is the reference: its figures over the rollout's own
    span (the last hour of it at most), or the same length before the rollout when that span has too
    few. The failure must then show in the new version's latest requests too (`_recent_start`), and the
    caller asks it to persist before acting on it (basis "before").
    Either way the new version is blamed only at a load like its reference's (`comparable_load`).
    """
    slos = _judged_slos(rollout.deployment)
    start, limit, min_requests = rollout.finished_at, limits["max_burn_rate"], limits["min_requests"]
    tracks = _track_stats(rollout, slos, start, end)
    new, held = tracks["candidate"], tracks["stable"]
    previous, checks = _against_the_past(rollout, slos, new, start, end, limits)
    if rollout.holdback_percent > 0 and held["requests"] + held["failed_attempts"] >= HOLDBACK_MIN_REQUESTS:
        comparable, load_note = comparable_load(new["load"], held["load"])
        checks = [_same_time_first(past, same_time, comparable, load_note)
                  for past, same_time in zip(checks, _held_back_checks(new, held, limit), strict=True)]
        previous = {**held, "concurrent": True, "before": previous,
                    "baseline": f"held back beside it ({rollout.holdback_percent}% of traffic, same time)"}
    failed = [c for c in checks if c["ok"] is False]
    new_n = new["requests"] + new["failed_attempts"]
    since = f"{new_n} requests on the new version since it took over"
    load = "load: " + load_text(new["load"], previous["load"])
    if new_n < min_requests:
        for check in failed:
            check.update(ok=None, note=not_enough_text(new_n, min_requests))
        verdict, reason = Verdict.RUNNING, f"{since}; judging needs {min_requests}. {load}."
    elif failed:
        verdict = Verdict.FAIL
        against = "at the same time" if any(c["basis"] == "same time" for c in failed) else "before it"
        reason = (f"the new version burns an SLO the previous one did not {against}: "
                  + "; ".join(_describe(c, "new", "previous") for c in failed) + f". {load}.")
    elif notes := [f"{c['name']}: {c['note']}" for c in checks if c["ok"] is None and c.get("note")]:
        verdict, reason = Verdict.RUNNING, f"{since}; not judged: {'; '.join(notes)}. {load}."
    else:
        verdict, reason = Verdict.RUNNING, f"{since}; every SLO within its limit. {load}."
    return Measurement(verdict, new, previous, checks, reason)


def _against_the_past(rollout: Rollout, slos: list[Slo], new: dict, start: datetime, end: datetime,
                      limits: dict) -> tuple[dict, list[dict]]:
    """(the previous version's figures before the switch, one check per SLO of the new version against
    them): failing only when the new version burns above the limit since the switch and lately, while
    the previous version did not, at a comparable load."""
    limit, min_requests = limits["max_burn_rate"], limits["min_requests"]
    span_start = max(rollout.created_at, start - WATCH_BASELINE_MAX)
    before = _track_stats(rollout, slos, span_start, start)["stable"]
    previous = _baseline(rollout, slos, before, span_start, start, min_requests, "the same length before the rollout")
    previous.setdefault("baseline", "the previous version during the rollout")
    # A previous version that burned above the limit too is never blamed on the new one.
    checks = [{**check, "basis": "before"} for check in _burn_checks(new, previous, limit, math.inf)]
    recent_start = _recent_start(rollout, start, end, min_requests)
    recent = _track_stats(rollout, slos, recent_start, end)["candidate"]
    new["recent"] = {"since": recent_start.isoformat(), "requests": recent["requests"], "slos": recent["slos"]}
    comparable, load_note = comparable_load(new["load"], previous["load"])
    for check, latest in zip(checks, _burn_checks(recent, previous, limit, math.inf), strict=True):
        if check["ok"] is False and latest["ok"] is not False:
            check.update(ok=None, note=f"burns {latest['candidate']} over its latest {recent['requests']} requests: "
                                       "no longer failing")
        elif check["ok"] is False and not comparable:
            check.update(ok=None, note=load_note)
    return previous, checks


def _same_time_first(past: dict, same_time: dict, comparable: bool, load_note: str) -> dict:
    """One SLO's check from both references: failing beside the held-back version at a comparable load
    stands; burning as it does is not the version's doing; anything else (too few requests on the
    holdback to tell, or more load than it) is judged against the past."""
    if same_time["ok"] is False and comparable:
        return {**same_time, "basis": "same time"}
    theirs = same_time["stable"]
    if same_time["ok"] is None and theirs is not None and theirs > same_time["limit"]:
        return {**same_time, "basis": "same time"}
    if same_time["ok"] is False:  # significantly worse, but under more load than the holdback
        return {**past, "same_time": {"stable": theirs, "p_value": same_time["p_value"], "note": load_note}}
    return past


_LATEST_CANDIDATE_EVENT = f"""
    SELECT e.time FROM tenants_usageevent e JOIN runtime_replica r ON r.id = e.replica
    WHERE e.deployment = %(deployment)s AND e.time >= %(start)s AND e.time < %(end)s AND {CANDIDATE_REPLICA_SQL}
    ORDER BY e.time DESC OFFSET %(skip)s LIMIT 1
"""


def _recent_start(rollout: Rollout, start: datetime, end: datetime, min_requests: int) -> datetime:
    """Where the new version's latest requests begin: WATCH_RECENT_S before `end`, or earlier to hold
    `min_requests` of them, never before `start`."""
    with connection.cursor() as cursor:
        cursor.execute(_LATEST_CANDIDATE_EVENT, {**candidate_params(rollout), "deployment": rollout.deployment.name,
                                                 "start": start, "end": end, "skip": min_requests - 1})
        row = cursor.fetchone()
    recent = end - timedelta(seconds=WATCH_RECENT_S)
    return max(start, min(recent, row[0]) if row else start)


def _held_back_checks(new: dict, held: dict, limit: float) -> list[dict]:
    """One check per SLO: the new version fails when it burns above `limit` and fails significantly more
    often than the held-back previous version at the same time; burning as much as that is not judged."""
    checks = []
    for name, figures in new["slos"].items():
        theirs = held["slos"].get(name, {"good": 0, "total": 0, "burn_rate": None})
        burn = figures["burn_rate"]
        check = {"name": f"{name} burn rate", "candidate": burn, "stable": theirs["burn_rate"], "limit": limit,
                 "ok": burn is None or burn <= limit}
        if not check["ok"]:
            p_value = worse_p_value(figures["total"] - figures["good"], figures["total"],
                                    theirs["total"] - theirs["good"], theirs["total"])
            check["p_value"] = round(p_value, 4)
            if p_value >= WORSE_P_VALUE:
                check.update(ok=None, note=f"not worse than the held-back version beside it, which burns "
                                           f"{theirs['burn_rate']} (p = {p_value:.2g})")
        checks.append(check)
    return checks


def worse_p_value(bad: int, total: int, other_bad: int, other_total: int) -> float:
    """One-sided Fisher exact test: the chance that `bad` of `total` events or more would be bad if both
    groups failed alike, given all bad events of the two (small: the first group fails more often)."""
    everything, all_bad = total + other_total, bad + other_bad

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    denominator = log_comb(everything, total)
    tail = sum(math.exp(log_comb(all_bad, x) + log_comb(everything - all_bad, total - x) - denominator)
               for x in range(bad, min(all_bad, total) + 1))
    return min(1.0, tail)


def comparable_load(new: dict, reference: dict) -> tuple[bool, str]:
    """Whether the new version ran at a load like its reference's: at most LOAD_TOLERANCE times its requests
    per replica, or without a queue of its own; else why not (more load alone makes any version slower)."""
    rate, base, queue = new["requests_per_s_per_replica"], reference["requests_per_s_per_replica"], new["queue_depth"]
    if not base or rate is None or rate <= LOAD_TOLERANCE * base or (queue is not None and queue < QUEUE_FREE):
        return True, ""
    queued = f" with {queue:g} requests waiting per replica" if queue is not None else ""
    return False, (f"the new version carried {rate / base:.1f}× the previous one's requests per replica{queued}, "
                   "so load, not the version, may explain the burn")


def load_text(new: dict, reference: dict) -> str:
    def one(load: dict) -> str:
        rate = load["requests_per_s_per_replica"]
        text = "no requests" if rate is None else f"{rate:g} req/s per replica on {load['replicas']}"
        return text + (f", {load['queue_depth']:g} waiting" if load["queue_depth"] is not None else "")
    return f"new {one(new)}; previous {one(reference)}"


def _describe(check: dict, candidate: str = "candidate", stable: str = "stable") -> str:
    return f"{check['name']}: {candidate} {check['candidate']}, {stable} {check['stable']}, limit {check['limit']}"


class SloRolloutGate:
    server_failure_sql = SERVER_FAILURE_SQL
    exhausted_slos = staticmethod(exhausted_slos)
    insufficient_traffic_slos = staticmethod(insufficient_traffic_slos)
    measure = staticmethod(measure)
    watch = staticmethod(watch)
