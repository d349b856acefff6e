"""Progressive rollouts: create and act on them (API, console, CLI), and advance them.

A rollout's state is its row. The reconcile pass of its deployment (runtime/reconcile.py), which
Celery runs every couple of seconds under the deployment's advisory lock, calls `advance()`
once per pass: each transition (warm, set weight, pause, judge, abort, finalize) is one
transaction on the row taken with SELECT ... FOR UPDATE, and the pass publishes the weights the
row says only after that commit. A worker killed anywhere leaves either the old row or the new
one, and the next pass continues from it; operator actions lock the same row.

Tracks: the stable spec is the deployment's own (version + engine args, pinned while a rollout
runs); the candidate's replicas carry the rollout's id, so analysis can tell them apart even
when only engine args differ.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from alerts.choices import AlertStatus, Severity
from alerts.models import Alert
from alerts.services import alert_raise, alert_resolve
from deployments.choices import ACTIVE_ROLLOUT, DriverName, RolloutStatus, Strategy, Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollout_spec import normalise
from deployments.services import request_reconcile, resolve_version, validate_engine_args
from inferops.api import Conflict
from registry.models import Alias, slug_validator
from registry.services import alias_set, audit_record, snapshot
from slo.choices import Scope, SliKind
from slo.models import Slo
from slo.sli import REQUEST_GOOD_SQL, REQUEST_TOTAL_SQL, SERVER_FAILURE_SQL

log = logging.getLogger(__name__)

ALERT_NAME = "RolloutAborted"
# How often a running analysis stores a measurement (the verdicts are stored whenever reached).
MEASURE_EVERY_S = 10.0
# Without an SLO on the deployment, analysis judges availability against this objective.
IMPLIED_OBJECTIVE = 0.99
# Both tracks burning: the candidate is blamed only when it burns this much more than stable.
BOTH_BURNING_RATIO = 1.2


# ---------------------------------------------------------------------------- actions


def _timeline(rollout: Rollout, now: datetime, event: str, detail: str = "") -> None:
    rollout.timeline = [*rollout.timeline, {"at": now.isoformat(), "event": event, "detail": detail}]


def _locked(rollout: Rollout) -> Rollout:
    return Rollout.objects.select_for_update().select_related("deployment").get(pk=rollout.pk)


def _locked_active(rollout: Rollout, done_to_it: str) -> Rollout:
    locked = _locked(rollout)
    if not locked.active:
        raise Conflict(f"Rollout {locked.pk} is {locked.status}; only a running or paused rollout is {done_to_it}.")
    return locked


def _who(actor) -> str:
    return getattr(actor, "username", None) or "system"


def exhausted_slos(deployment: Deployment) -> list[tuple[str, float]]:
    """(SLO name, budget remaining) of every SLO on this deployment whose error budget is spent."""
    covering = Slo.objects.filter(
        Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id),
        status__budget_remaining__lte=0,
    ).values_list("name", "status__budget_remaining")
    return sorted(covering)


def _check_budget(deployment: Deployment, *, rollback: bool, override_reason: str) -> None:
    if rollback or override_reason:
        return
    exhausted = exhausted_slos(deployment)
    if exhausted:
        names = ", ".join(f"{name!r} ({-remaining:.0%} over its budget)" for name, remaining in exhausted)
        raise Conflict(
            f"Error budget exhausted for SLO {names} on deployment {deployment.name!r}: new rollouts are "
            "refused until it recovers. A rollback (\"rollback\": true, or the undo action) is allowed; "
            "to go ahead anyway give \"override_reason\" (audited)."
        )


def rollout_create(*, deployment: Deployment, actor, version: int | None = None, alias: str | None = None,
                   engine_args: dict | None = None, strategy: str = Strategy.CANARY, steps=None,
                   scale_down_delay=None, preview=None, analysis=None, rollback: bool = False,
                   override_reason: str = "", promote_alias: str = "champion") -> Rollout:
    """Validate everything, then start a rollout; 409 while another runs or a budget is spent."""
    normalised_steps, delay = normalise(strategy, steps=steps, scale_down_delay=scale_down_delay,
                                        preview=preview, analysis=analysis)
    if promote_alias:  # checked now: a bad name would otherwise fail the finalizing transaction every pass
        try:
            slug_validator(promote_alias)
        except ValidationError as exc:
            raise ValidationError({"promote_alias": exc.messages}) from None
    if version is None and not alias and engine_args is None:
        raise ValidationError({"version": ["Give the candidate: a version, an alias and/or engine_args."]})
    now = timezone.now()
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("model", "version").get(pk=deployment.pk)
        if locked.deleted_at:
            raise Conflict(f"Deployment {locked.name!r} is being deleted.")
        if locked.paused:
            raise Conflict(f"Deployment {locked.name!r} is paused; resume it before rolling out.")
        candidate = (resolve_version(locked.model, version=version, alias=alias)
                     if version is not None or alias else locked.version)
        candidate_args = (validate_engine_args(locked.backend, engine_args) if engine_args is not None
                          else locked.engine_args)
        if candidate.pk == locked.version_id and candidate_args == locked.engine_args:
            raise ValidationError({"version": [
                f"The candidate (v{candidate.number} with the same engine args) is what {locked.name!r} "
                "already serves: nothing to roll out."]})
        if candidate.pk == locked.version_id and locked.driver == DriverName.KUBERNETES:
            # The Kubernetes driver keeps one Deployment object per version: two tracks of one
            # version would fight over it.
            raise ValidationError({"engine_args": [
                "On Kubernetes a candidate must be a new version; register the same checkpoint as a new "
                "version to roll out engine args alone."]})
        active = locked.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
        if active is not None:
            raise Conflict(f"Rollout {active.pk} of {locked.name!r} is {active.status}; promote or abort it first.")
        _check_budget(locked, rollback=rollback, override_reason=override_reason)
        rollout = Rollout(
            deployment=locked, strategy=strategy, steps=normalised_steps, scale_down_delay_s=delay,
            rollback=rollback, override_reason=override_reason, stable_version=locked.version,
            stable_engine_args=locked.engine_args, candidate_version=candidate, candidate_engine_args=candidate_args,
            candidate_alias=alias or "", promote_alias=promote_alias, step_started_at=now,
            created_by=actor if getattr(actor, "pk", None) else None,
        )
        rollout.full_clean(exclude=["deployment", "stable_version", "candidate_version", "created_by"])
        _timeline(rollout, now, "created", f"v{locked.version.number} → v{candidate.number} ({strategy})"
                  + (f"; budget policy overridden: {override_reason}" if override_reason else ""))
        _enter_step(rollout, 0, now)
        try:
            with transaction.atomic():
                rollout.save()
        except IntegrityError:  # a concurrent request created one between our check and insert
            raise Conflict(f"Another rollout of {locked.name!r} started at the same time.") from None
        audit_record(actor=actor, action="rollout.create", obj=rollout, after=snapshot(rollout))
        if override_reason and (exhausted := exhausted_slos(locked)):
            audit_record(actor=actor, action="rollout.budget_override", obj=rollout,
                         after={"reason": override_reason, "exhausted": exhausted})
        request_reconcile(locked)
    return rollout


def rollout_promote(*, rollout: Rollout, actor, full: bool = False) -> Rollout:
    """Next step now (ends a pause, skips the rest of an analysis), or all the way with `full`."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_active(rollout, "promoted")
        step = locked.current_step
        if not full and (step is None or "set_weight" in step):
            # Skipping a weight would send traffic the candidate was never warmed (or judged) for.
            raise Conflict(f"Rollout {locked.pk} is warming the candidate for its next weight and moves on by "
                           "itself once it is ready; promote ends a pause or an analysis (or use full).")
        before = snapshot(locked)
        target = len(locked.steps) if full else locked.step_index + 1
        _timeline(locked, now, "promoted", f"by {_who(actor)}" + (" (full)" if full else ""))
        _enter_step(locked, target, now)
        locked.save()
        audit_record(actor=actor, action="rollout.promote", obj=locked, before=before, after=snapshot(locked))
        request_reconcile(locked.deployment)
    return locked


def rollout_abort(*, rollout: Rollout, actor, reason: str = "") -> Rollout:
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_active(rollout, "aborted")
        before = snapshot(locked)
        _abort(locked, now, f"aborted by {_who(actor)}" + (f": {reason}" if reason else ""))
        audit_record(actor=actor, action="rollout.abort", obj=locked, before=before, after=snapshot(locked))
        request_reconcile(locked.deployment)
    return locked


def rollout_retry(*, rollout: Rollout, actor, override_reason: str = "") -> Rollout:
    """Start an aborted rollout again from its first step."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked(rollout)
        if locked.status != RolloutStatus.ABORTED:
            raise Conflict(f"Rollout {locked.pk} is {locked.status}; only an aborted rollout is retried.")
        deployment = Deployment.objects.select_for_update().get(pk=locked.deployment_id)
        if (deployment.version_id, deployment.engine_args) != (locked.stable_version_id, locked.stable_engine_args):
            raise Conflict("The deployment changed since this rollout started; create a new rollout instead.")
        other = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
        if other is not None:
            raise Conflict(f"Rollout {other.pk} of {deployment.name!r} is {other.status}; promote or abort it first.")
        _check_budget(deployment, rollback=locked.rollback, override_reason=override_reason)
        before = snapshot(locked)
        locked.finished_at = None
        locked.weight = 0
        locked.attempt += 1
        if override_reason:
            locked.override_reason = override_reason
        _timeline(locked, now, "retried", f"by {_who(actor)}")
        _enter_step(locked, 0, now)
        locked.save()
        _resolve_abort_alerts(deployment, now)
        audit_record(actor=actor, action="rollout.retry", obj=locked, before=before, after=snapshot(locked))
        if override_reason and (exhausted := exhausted_slos(deployment)):
            audit_record(actor=actor, action="rollout.budget_override", obj=locked,
                         after={"reason": override_reason, "exhausted": exhausted})
        request_reconcile(deployment)
    return locked


def undo_target(deployment: Deployment) -> Rollout | None:
    """The succeeded rollout that brought the deployment to what it serves now, if any."""
    last = (deployment.rollouts.filter(status=RolloutStatus.SUCCEEDED, candidate_version_id=deployment.version_id)
            .select_related("stable_version").order_by("-finished_at", "-id").first())
    return last if last is not None and last.candidate_engine_args == deployment.engine_args else None


def rollout_undo(*, deployment: Deployment, actor) -> Rollout:
    """Back to the previous spec: aborts a running rollout, else rolls back the last one that succeeded.

    The rollback is blue-green with no analysis: when the old set is still warm (a blue-green's
    scale-down delay) traffic moves on the next pass; otherwise the old spec is started at full
    size first and takes all traffic once ready.
    """
    active = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
    if active is not None:
        return rollout_abort(rollout=active, actor=actor, reason="undo")
    deployment.refresh_from_db()
    last = undo_target(deployment)
    if last is None:
        raise Conflict(f"Nothing to undo: no succeeded rollout brought {deployment.name!r} to what it serves now.")
    return rollout_create(
        deployment=deployment, actor=actor, version=last.stable_version.number,
        engine_args=last.stable_engine_args, strategy=Strategy.BLUE_GREEN, rollback=True,
        promote_alias=last.promote_alias,
    )


# ---------------------------------------------------------------------------- the state machine


def candidate_size(rollout: Rollout, replicas: int) -> int:
    """Candidate replicas to keep started: enough for the weight it has or is about to get.

    Never zero while the rollout runs, so the candidate is warm before its first traffic.
    """
    if rollout.strategy == Strategy.BLUE_GREEN:
        return replicas
    step = rollout.current_step
    upcoming = 100 if step is None else step.get("set_weight", rollout.weight)
    return _needed(max(upcoming, rollout.weight), replicas)


def _needed(weight: int, replicas: int) -> int:
    return max(1, math.ceil(replicas * weight / 100))


def _enter_step(rollout: Rollout, index: int, now: datetime) -> None:
    rollout.step_index = index
    rollout.step_started_at = now
    step = rollout.current_step
    if step is not None and "pause" in step:
        rollout.status = RolloutStatus.PAUSED
        seconds = step["pause"]
        rollout.message = ("Paused until an operator promotes." if seconds is None
                           else f"Paused for {seconds:g}s (until {now + timedelta(seconds=seconds):%H:%M:%S} UTC).")
    else:
        rollout.status = RolloutStatus.PROGRESSING
        rollout.message = ""


def _abort(rollout: Rollout, now: datetime, reason: str) -> None:
    rollout.status = RolloutStatus.ABORTED
    rollout.weight = 0
    rollout.finished_at = now
    rollout.message = reason
    _timeline(rollout, now, "aborted", reason)
    _timeline(rollout, now, "traffic on stable", f"v{rollout.stable_version.number} takes 100%")
    rollout.save()
    alert_raise(
        labels={"alertname": ALERT_NAME, "deployment": rollout.deployment.name, "rollout": str(rollout.pk),
                "severity": Severity.TICKET},
        annotations={"summary": f"Rollout {rollout.pk} of {rollout.deployment.name} was aborted and rolled back",
                     "description": reason,
                     "rollout_url": f"{settings.INFEROPS_EXTERNAL_URL}/deployments/{rollout.deployment.name}"
                                    f"/rollouts/{rollout.pk}/"},
        severity=Severity.TICKET, now=now,
    )
    log.warning("rollout %s aborted: %s", rollout.pk, reason)


def _resolve_abort_alerts(deployment: Deployment, now: datetime) -> None:
    for alert in Alert.objects.filter(status=AlertStatus.FIRING, labels__alertname=ALERT_NAME,
                                      labels__deployment=deployment.name):
        alert_resolve(alert=alert, now=now)


def _finalize(rollout: Rollout, deployment: Deployment, now: datetime) -> None:
    """The candidate becomes the deployment's spec (and the alias moves to it), in one transaction."""
    before = snapshot(deployment)
    deployment.version = rollout.candidate_version
    deployment.engine_args = rollout.candidate_engine_args
    deployment.alias = rollout.candidate_alias
    deployment.save(update_fields=["version", "engine_args", "alias", "updated_at"])
    audit_record(actor=None, action="deployment.update", obj=deployment, before=before, after=snapshot(deployment))
    rollout.status = RolloutStatus.SUCCEEDED
    rollout.weight = 100
    rollout.finished_at = now
    rollout.message = ""
    if rollout.strategy == Strategy.BLUE_GREEN and rollout.scale_down_delay_s:
        rollout.scale_down_at = now + timedelta(seconds=rollout.scale_down_delay_s)
    _timeline(rollout, now, "succeeded", f"v{rollout.candidate_version.number} serves all traffic")
    rollout.save()
    if rollout.promote_alias:
        current = Alias.objects.filter(model_id=deployment.model_id, name=rollout.promote_alias).first()
        if current is None or current.version_id != rollout.candidate_version_id:
            alias_set(model=deployment.model, name=rollout.promote_alias, version=rollout.candidate_version,
                      actor=None)
            _timeline(rollout, now, "alias moved", f"{rollout.promote_alias} → v{rollout.candidate_version.number}")
            rollout.save(update_fields=["timeline"])
    _resolve_abort_alerts(deployment, now)


@dataclass(frozen=True)
class CandidateState:
    """What the reconcile pass observed of the candidate's replicas."""

    ready: int
    failure: str = ""  # set when they crash-loop: the rollout aborts


def advance(deployment: Deployment, state: CandidateState, now: datetime) -> Rollout | None:
    """Take every transition that is due now; returns the deployment's active rollout after them."""
    with transaction.atomic():
        rollout = (Rollout.objects.select_for_update().select_related("stable_version", "candidate_version")
                   .filter(deployment=deployment, status__in=ACTIVE_ROLLOUT).first())
        if rollout is None:
            return None
        rollout.deployment = deployment
        for _ in range(len(rollout.steps) + 2):  # bounded: each turn moves at least one step on
            if not rollout.active or not _step_once(rollout, deployment, state, now):
                break
        rollout.save()
    return rollout if rollout.active else None


def _step_once(rollout: Rollout, deployment: Deployment, state: CandidateState, now: datetime) -> bool:
    """One transition if due; True when the rollout moved on (and may move again)."""
    if state.failure:
        _abort(rollout, now, f"candidate replicas crash-looping: {state.failure}")
        return False
    step = rollout.current_step
    elapsed = (now - rollout.step_started_at).total_seconds()
    if step is None:  # every step done: the candidate takes everything once it has full size
        if state.ready >= deployment.replicas:
            _finalize(rollout, deployment, now)
            return False
        rollout.message = f"Scaling the candidate up: {state.ready}/{deployment.replicas} replicas ready."
        return False
    if "set_weight" in step:
        weight = step["set_weight"]
        needed = (deployment.replicas if rollout.strategy == Strategy.BLUE_GREEN
                  else _needed(weight, deployment.replicas))
        if state.ready < needed:
            rollout.message = f"Warming the candidate: {state.ready}/{needed} replicas ready before {weight}% traffic."
            return False
        rollout.weight = weight
        _timeline(rollout, now, "weight", f"{weight}% on the candidate")
        _enter_step(rollout, rollout.step_index + 1, now)
        return True
    if "pause" in step:
        if step["pause"] is not None and elapsed >= step["pause"]:
            _enter_step(rollout, rollout.step_index + 1, now)
            return True
        return False
    if rollout.status == RolloutStatus.PAUSED:  # an inconclusive analysis waits for an operator
        return False
    return _analyse(rollout, step["analysis"], now, elapsed)


def _analyse(rollout: Rollout, config: dict, now: datetime, elapsed: float) -> bool:
    window_over = elapsed >= config["duration"]
    result = measure(rollout, config, rollout.step_started_at, now, final=window_over)
    this_step = RolloutMeasurement.objects.filter(rollout=rollout, attempt=rollout.attempt,
                                                  step_index=rollout.step_index)
    last = this_step.order_by("-taken_at").values_list("taken_at", flat=True).first()
    if result.verdict != Verdict.RUNNING or last is None or (now - last).total_seconds() >= MEASURE_EVERY_S:
        RolloutMeasurement.objects.create(
            rollout=rollout, attempt=rollout.attempt, step_index=rollout.step_index, taken_at=now,
            window_start=rollout.step_started_at, window_end=now, verdict=result.verdict,
            candidate=result.candidate, stable=result.stable, checks=result.checks, reason=result.reason,
        )
    if result.verdict == Verdict.FAIL:
        _timeline(rollout, now, "analysis failed", result.reason)
        _abort(rollout, now, f"analysis failed: {result.reason}")
        return False
    if result.verdict == Verdict.INCONCLUSIVE:
        rollout.status = RolloutStatus.PAUSED
        rollout.message = f"Analysis inconclusive: {result.reason} Promote to continue or abort."
        _timeline(rollout, now, "analysis inconclusive", result.reason)
        return False
    if result.verdict == Verdict.PASS:
        _timeline(rollout, now, "analysis passed", result.reason)
        _enter_step(rollout, rollout.step_index + 1, now)
        return True
    rollout.message = f"Analysing: {result.reason}"
    return False


# ---------------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class Measurement:
    verdict: str
    candidate: dict
    stable: dict
    checks: list
    reason: str


# Events of one deployment in a window, each labelled with the track that served it.
_TRACKED_EVENTS = """
    SELECT e.*, CASE WHEN r.rollout_id = %(rollout)s THEN 'candidate' ELSE 'stable' END AS track
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
_FAILED_ATTEMPTS = """
    SELECT CASE WHEN r.rollout_id = %(rollout)s THEN 'candidate' ELSE 'stable' END, count(*)
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
    params = {"rollout": rollout.pk, "deployment": rollout.deployment.name, "start": start, "end": end,
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


def measure(rollout: Rollout, config: dict, start: datetime, end: datetime, *, final: bool) -> Measurement:
    """Candidate vs stable over [start, end): burn rate per SLO, optional thresholds, a verdict.

    The stable baseline is the same window, or — when stable served too little of it (blue-green
    after the switch) — the window of the same length before the step.
    """
    deployment = rollout.deployment
    slos = list(Slo.objects.filter(Q(deployment=deployment) | Q(scope=Scope.MODEL, model_id=deployment.model_id))
                .exclude(sli_kind=SliKind.RATIO).order_by("name"))
    tracks = _track_stats(rollout, slos, start, end)
    candidate, stable = tracks["candidate"], tracks["stable"]
    min_requests = config["min_requests"]
    if stable["requests"] < min_requests:
        baseline = _track_stats(rollout, slos, start - (end - start), start)["stable"]
        if baseline["requests"] > stable["requests"]:
            stable = {**baseline, "baseline": "the window before this step"}
    candidate_n = candidate["requests"] + candidate["failed_attempts"]
    checks = []
    for name, figures in candidate["slos"].items():
        burn = figures["burn_rate"]
        stable_burn = stable["slos"].get(name, {}).get("burn_rate")
        ok = burn is None or burn <= config["max_burn_rate"]
        if not ok and stable_burn is not None and stable_burn > config["max_burn_rate"] \
                and burn <= stable_burn * BOTH_BURNING_RATIO:
            ok = None  # both burn alike: not the candidate's doing
        checks.append({"name": f"{name} burn rate", "candidate": burn, "stable": stable_burn,
                       "limit": config["max_burn_rate"], "ok": ok})
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


def _describe(check: dict) -> str:
    return f"{check['name']}: candidate {check['candidate']}, stable {check['stable']}, limit {check['limit']}"
