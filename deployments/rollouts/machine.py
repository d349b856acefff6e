"""The rollout state machine and its analysis step, run by the reconcile pass.

A rollout's state is its row. The reconcile pass of its deployment (deployments/replicas/reconcile.py),
which Celery runs every couple of seconds under the deployment's advisory lock, calls `advance()`
once per pass: each transition (warm, set weight, pause, judge, abort, finalize) is one
transaction on the row taken with SELECT ... FOR UPDATE, and the pass publishes the weights the
row says only after that commit. A worker killed anywhere leaves either the old row or the new
one, and the next pass continues from it; operator actions (deployments/rollouts/services.py) lock the
same row.

Tracks: the stable spec is the deployment's own (version + engine args, pinned while a rollout
runs); the candidate's replicas carry the rollout's id, so analysis can tell them apart even
when only engine args differ. Analysis compares the tracks through the SLO module's gate
(deployments/rollouts/gate.py); a quality step scores the candidate on an eval set through the
evals app's implementation (deployments/rollouts/quality.py), its runs kept on the row.

While the deployment's degradation level freezes rollouts, a rollout that is not a rollback takes
no weight, pause or analysis transition: its weight holds until the level lifts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from alerts.choices import Severity
from alerts.services import alert_raise, alerts_resolve_open
from deployments.choices import ACTIVE_ROLLOUT, RolloutStatus, Strategy, Verdict
from deployments.models import Deployment, Rollout, RolloutMeasurement
from deployments.rollouts.gate import gate, low_traffic_guard
from deployments.rollouts.quality import QualityVerdict, limits_text, quality, state_key
from deployments.services import frozen_by, level_text
from inferops.audit import audit_record, snapshot
from registry.models import Alias
from registry.services import alias_set

log = logging.getLogger(__name__)

ALERT_NAME = "RolloutAborted"
ROLLED_BACK_ALERT = "RolloutRolledBack"
# How often a running analysis stores a measurement (the verdicts are stored whenever reached).
MEASURE_EVERY_S = 10.0


def add_timeline(rollout: Rollout, now: datetime, event: str, detail: str = "") -> None:
    rollout.timeline = [*rollout.timeline, {"at": now.isoformat(), "event": event, "detail": detail}]


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


def enter_step(rollout: Rollout, index: int, now: datetime) -> None:
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


def raise_alert(rollout: Rollout, now: datetime, alertname: str, summary: str, reason: str,
                links: dict | None = None) -> None:
    """A ticket alert that links the rollout's page (and `links`, e.g. the failing cases of a quality step)."""
    alert_raise(
        labels={"alertname": alertname, "deployment": rollout.deployment.name, "rollout": str(rollout.pk),
                "severity": Severity.TICKET},
        annotations={"summary": summary, "description": reason,
                     "rollout_url": f"{settings.INFEROPS_EXTERNAL_URL}/deployments/{rollout.deployment.name}"
                                    f"/rollouts/{rollout.pk}/", **(links or {})},
        severity=Severity.TICKET, now=now,
    )


def stop_quality_runs(rollout: Rollout) -> None:
    """Cancel what the current quality step's eval runs still do: the step ends without them."""
    entry = rollout.quality.get(state_key(rollout))
    if entry is not None:
        quality().stop(entry["state"])


def abort(rollout: Rollout, now: datetime, reason: str, links: dict | None = None) -> None:
    stop_quality_runs(rollout)
    rollout.status = RolloutStatus.ABORTED
    rollout.weight = 0
    rollout.finished_at = now
    rollout.message = reason
    add_timeline(rollout, now, "aborted", reason)
    add_timeline(rollout, now, "traffic on stable", f"v{rollout.stable_version.number} takes 100%")
    rollout.save()
    raise_alert(rollout, now, ALERT_NAME,
                f"Rollout {rollout.pk} of {rollout.deployment.name} was aborted and rolled back", reason, links)
    log.warning("rollout %s aborted: %s", rollout.pk, reason)


def resolve_abort_alerts(deployment: Deployment, now: datetime, names: tuple[str, ...] = (ALERT_NAME,)) -> None:
    alerts_resolve_open(now=now, alertnames=names, deployment=deployment.name)


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
    if rollout.watch_s and not rollout.rollback:  # a rollback is never rolled back by the platform
        rollout.watch_until = now + timedelta(seconds=rollout.watch_s)
    add_timeline(rollout, now, "succeeded", f"v{rollout.candidate_version.number} serves all traffic")
    rollout.save()
    if rollout.promote_alias:
        current = Alias.objects.filter(model_id=deployment.model_id, name=rollout.promote_alias).first()
        if current is None or current.version_id != rollout.candidate_version_id:
            alias_set(model=deployment.model, name=rollout.promote_alias, version=rollout.candidate_version,
                      actor=None)
            add_timeline(rollout, now, "alias moved", f"{rollout.promote_alias} → v{rollout.candidate_version.number}")
            rollout.save(update_fields=["timeline"])
    # A new version that made it closes the tickets of earlier failures; a rollback's success
    # leaves open the ticket of the rollout the platform rolled back.
    resolve_abort_alerts(deployment, now, (ALERT_NAME,) if rollout.rollback else (ALERT_NAME, ROLLED_BACK_ALERT))


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
        abort(rollout, now, f"candidate replicas crash-looping: {state.failure}")
        return False
    step = rollout.current_step
    elapsed = (now - rollout.step_started_at).total_seconds()
    if step is None:  # every step done: the candidate takes everything once it has full size
        if state.ready >= deployment.replicas:
            _finalize(rollout, deployment, now)
            return False
        rollout.message = f"Scaling the candidate up: {state.ready}/{deployment.replicas} replicas ready."
        return False
    level = None if rollout.rollback else frozen_by(deployment)
    if level is not None:
        _freeze(rollout, level, now)
        return False
    if rollout.frozen_since is not None:
        _thaw(rollout, step, now)
        return True  # the step's clock may have restarted: look again
    if "set_weight" in step:
        weight = step["set_weight"]
        needed = (deployment.replicas if rollout.strategy == Strategy.BLUE_GREEN
                  else _needed(weight, deployment.replicas))
        if state.ready < needed:
            rollout.message = f"Warming the candidate: {state.ready}/{needed} replicas ready before {weight}% traffic."
            return False
        rollout.weight = weight
        add_timeline(rollout, now, "weight", f"{weight}% on the candidate")
        enter_step(rollout, rollout.step_index + 1, now)
        return True
    if "pause" in step:
        if step["pause"] is not None and elapsed >= step["pause"]:
            enter_step(rollout, rollout.step_index + 1, now)
            return True
        return False
    if rollout.status == RolloutStatus.PAUSED:  # an inconclusive analysis or quality step waits for an operator
        return False
    if "quality" in step:
        return _score_quality(rollout, step["quality"], state, now, elapsed)
    return _analyse(rollout, step["analysis"], now, elapsed)


def _freeze(rollout: Rollout, level: dict, now: datetime) -> None:
    """Hold the weight where it is while the deployment's degradation level freezes rollouts."""
    if rollout.frozen_since is None:
        rollout.frozen_since = now
        add_timeline(rollout, now, "frozen", f"{level_text(level)} freezes rollouts; {rollout.weight}% holds")
    rollout.message = (f"Frozen by {level_text(level)}: the weight holds at {rollout.weight}% and the rollout "
                       "continues by itself when the deployment leaves that level (abort is allowed).")


def _thaw(rollout: Rollout, step: dict, now: datetime) -> None:
    add_timeline(rollout, now, "unfrozen", f"after {(now - rollout.frozen_since).total_seconds():.0f}s")
    rollout.frozen_since = None
    rollout.message = ""
    if "set_weight" not in step:
        # The step starts over: a pause runs in full, and an analysis judges none of the degraded traffic.
        enter_step(rollout, rollout.step_index, now)


def _analyse(rollout: Rollout, config: dict, now: datetime, elapsed: float) -> bool:
    window_over = elapsed >= config["duration"]
    result = low_traffic_guard(gate().measure(rollout, config, rollout.step_started_at, now, final=window_over),
                               config, final=window_over)
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
        add_timeline(rollout, now, "analysis failed", result.reason)
        abort(rollout, now, f"analysis failed: {result.reason}")
        return False
    if result.verdict == Verdict.INCONCLUSIVE:
        rollout.status = RolloutStatus.PAUSED
        rollout.message = f"Analysis inconclusive: {result.reason} Promote to continue or abort."
        add_timeline(rollout, now, "analysis inconclusive", result.reason)
        return False
    if result.verdict == Verdict.PASS:
        add_timeline(rollout, now, "analysis passed", result.reason)
        enter_step(rollout, rollout.step_index + 1, now)
        return True
    rollout.message = f"Analysing: {result.reason}"
    return False


def _score_quality(rollout: Rollout, config: dict, state: CandidateState, now: datetime, elapsed: float) -> bool:
    """A quality step: start the eval runs once (this pass holds the row's lock, and they are created in its
    transaction), then judge them on every pass until a verdict or the step's timeout."""
    key = state_key(rollout)
    entry = rollout.quality.get(key)
    if entry is None:
        if state.ready < 1:  # scored through the preview route: someone must answer it
            rollout.message = "Warming the candidate: 0/1 replicas ready before its quality step."
            return False
        entry = _start_quality(rollout, config, now)
        if entry is None:
            return False
    result = quality().verdict(rollout, config, entry["state"])
    entry = {**entry, "verdict": result.verdict, "reason": result.reason, "link": result.link,
             "candidate": result.candidate, "stable": result.stable, "checks": result.checks}
    rollout.quality = {**rollout.quality, key: entry}
    if result.verdict == Verdict.RUNNING:
        if elapsed < config["timeout"]:
            rollout.message = f"Scoring quality: {result.reason}"
            return False
        reason = f"quality {config['eval_set']}: no verdict within {config['timeout']:g}s ({result.reason})"
        entry["verdict"] = Verdict.FAIL
        _record_quality(rollout, replace(result, verdict=Verdict.FAIL, reason=reason), now)
        add_timeline(rollout, now, "quality timed out", reason)
        abort(rollout, now, f"quality step timed out: {reason}")
        return False
    _record_quality(rollout, result, now)
    if result.verdict == Verdict.FAIL:
        reason = result.reason + (f"; failing cases: {result.link}" if result.link else "")
        add_timeline(rollout, now, "quality failed", reason)
        abort(rollout, now, f"quality failed: {reason}",
              {"failing_cases_url": result.link} if result.link else None)
        return False
    if result.verdict == Verdict.INCONCLUSIVE:
        rollout.status = RolloutStatus.PAUSED
        rollout.message = f"Quality inconclusive: {result.reason} Promote to continue, or abort (retry scores again)."
        add_timeline(rollout, now, "quality inconclusive", result.reason)
        return False
    add_timeline(rollout, now, "quality passed", result.reason)
    enter_step(rollout, rollout.step_index + 1, now)
    return True


def _start_quality(rollout: Rollout, config: dict, now: datetime) -> dict | None:
    """Ask the evals app to start scoring; the entry kept on the row, or None when it cannot start (the rollout
    then waits for an operator)."""
    try:
        with transaction.atomic():  # a refusal leaves no half-created run behind
            started = quality().start(rollout, config)
    except ValidationError as exc:
        reason = "; ".join(exc.messages)
        rollout.status = RolloutStatus.PAUSED
        rollout.message = (f"Quality step could not start: {reason}. Promote to skip it, or abort and fix the "
                           "step.")
        add_timeline(rollout, now, "quality inconclusive", f"could not start: {reason}")
        return None
    entry = {"eval_set": config["eval_set"], "attempt": rollout.attempt, "step_index": rollout.step_index,
             "started_at": now.isoformat(), "state": started}
    rollout.quality = {**rollout.quality, state_key(rollout): entry}
    runs = ", ".join(f"{role} run {run}" for role, run in started.get("runs", {}).items())
    add_timeline(rollout, now, "quality started", f"{config['eval_set']} ({limits_text(config)}): {runs}")
    return entry


def _record_quality(rollout: Rollout, result: QualityVerdict, now: datetime) -> None:
    """The step's verdict as a measurement, beside the analysis ones (API and console show both)."""
    RolloutMeasurement.objects.create(
        rollout=rollout, attempt=rollout.attempt, step_index=rollout.step_index, taken_at=now,
        window_start=rollout.step_started_at, window_end=now, verdict=result.verdict,
        candidate=result.candidate, stable=result.stable, checks=result.checks, reason=result.reason,
    )
