"""Progressive rollouts: what operators and CI do to them (API, console, CLI).

Each action locks the rollout's row (or its deployment's) and asks the reconcile pass to run;
the pass advances the rollout (deployments/rollouts/machine.py). A rollout is refused while an
error budget of the deployment is spent, unless it is a rollback or an operator overrides it
with a reason (audited), and while the deployment's degradation level freezes rollouts, unless it
is a rollback.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments.choices import ACTIVE_ROLLOUT, DriverName, RolloutStatus, Strategy
from deployments.models import Deployment, Rollout
from deployments.rollouts.gate import gate
from deployments.rollouts.machine import abort, add_timeline, enter_step, resolve_abort_alerts, stop_quality_runs
from deployments.rollouts.quality import quality as quality_checks
from deployments.rollouts.spec import holdback_percent, normalise, watch_seconds
from deployments.services import (
    check_frozen,
    frozen_by,
    level_text,
    request_reconcile,
    validate_engine_args,
    validate_runnable,
)
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.validators import slug_validator
from registry.services import resolve_version


def _locked(rollout: Rollout) -> Rollout:
    return Rollout.objects.select_for_update().select_related("deployment").get(pk=rollout.pk)


def _locked_active(rollout: Rollout, done_to_it: str) -> Rollout:
    locked = _locked(rollout)
    if not locked.active:
        raise Conflict(f"Rollout {locked.pk} is {locked.status}; only a running or paused rollout is {done_to_it}.")
    return locked


def _who(actor) -> str:
    return getattr(actor, "username", None) or "system"


def _check_budget(deployment: Deployment, *, rollback: bool, override_reason: str) -> None:
    if rollback or override_reason:
        return
    exhausted = gate().exhausted_slos(deployment)
    if exhausted:
        names = ", ".join(f"{name!r} ({-remaining:.0%} over its budget)" for name, remaining in exhausted)
        raise Conflict(
            f"Error budget exhausted for SLO {names} on deployment {deployment.name!r}: new rollouts are "
            "refused until it recovers. A rollback (\"rollback\": true, or the undo action) is allowed; "
            "to go ahead anyway give \"override_reason\" (audited)."
        )


def _check_quality_steps(strategy: str, steps: list) -> None:
    """Every quality step's eval set (and version) exists: asked of the evals app, which deployments does not
    import. ValidationError naming each step's field."""
    errors: dict[str, list[str]] = {}
    for index, step in enumerate(steps):
        if "quality" in step:
            canary = strategy == Strategy.CANARY
            field, prefix = ("steps", f"steps[{index}].quality") if canary else ("quality", "quality")
            problems = quality_checks().validate(step["quality"])
            errors.setdefault(field, []).extend(f"{prefix}.{problem}" for problem in problems)
    if any(errors.values()):
        raise ValidationError({field: messages for field, messages in errors.items() if messages})


def rollout_create(*, deployment: Deployment, actor, version: int | None = None, alias: str | None = None,
                   engine_args: dict | None = None, strategy: str = Strategy.CANARY, steps=None,
                   scale_down_delay=None, preview=None, analysis=None, quality=None, rollback: bool = False,
                   override_reason: str = "", promote_alias: str = "champion", watch=None,
                   auto_rollback: bool = True, holdback: int | None = None, redeploys: Rollout | None = None,
                   reason: str = "") -> Rollout:
    """Validate everything, then start a rollout; 409 while another runs, a budget is spent or a
    degradation level freezes rollouts. `redeploys` names a rollout the platform rolled back whose
    candidate this one brings back, for `reason` (see rollout_undo)."""
    normalised_steps, delay = normalise(strategy, steps=steps, scale_down_delay=scale_down_delay,
                                        preview=preview, analysis=analysis, quality=quality)
    _check_quality_steps(strategy, normalised_steps)
    watch_s = watch_seconds(watch)
    holdback_pct = holdback_percent(holdback)
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
        if not rollback:  # a rollback returns to what ran; never block it on a check added since
            validate_runnable(version=candidate, backend=locked.backend, driver=locked.driver,
                              engine_args=candidate_args, resources=locked.resources)
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
        check_frozen(locked, rollback=rollback)
        _check_budget(locked, rollback=rollback, override_reason=override_reason)
        rollout = Rollout(
            deployment=locked, strategy=strategy, steps=normalised_steps, scale_down_delay_s=delay,
            watch_s=watch_s, auto_rollback=auto_rollback, holdback_percent=holdback_pct,
            rollback=rollback, override_reason=override_reason, stable_version=locked.version,
            stable_engine_args=locked.engine_args, candidate_version=candidate, candidate_engine_args=candidate_args,
            candidate_alias=alias or "", promote_alias=promote_alias, step_started_at=now,
            created_by=actor_or_none(actor),
        )
        rollout.full_clean(exclude=["deployment", "stable_version", "candidate_version", "created_by"])
        add_timeline(rollout, now, "created", f"v{locked.version.number} → v{candidate.number} ({strategy})"
                     + (f"; budget policy overridden: {override_reason}" if override_reason else ""))
        if redeploys is not None:
            add_timeline(rollout, now, "redeploys a rejected version",
                         f"v{candidate.number} was rolled back by the platform in rollout {redeploys.pk}; "
                         f"{_who(actor)} brings it back: {reason}")
        enter_step(rollout, 0, now)
        try:
            with transaction.atomic():
                rollout.save()
        except IntegrityError:  # a concurrent request created one between our check and insert
            raise Conflict(f"Another rollout of {locked.name!r} started at the same time.") from None
        audit_record(actor=actor, action="rollout.create", obj=rollout, after=snapshot(rollout))
        if redeploys is not None:
            audit_record(actor=actor, action="rollout.redeploy_rejected", obj=rollout,
                         after={"rejected_by_platform_in": redeploys.pk, "reason": reason})
        if override_reason and (exhausted := gate().exhausted_slos(locked)):
            audit_record(actor=actor, action="rollout.budget_override", obj=rollout,
                         after={"reason": override_reason, "exhausted": exhausted})
        request_reconcile(locked)
    return rollout


def rollout_promote(*, rollout: Rollout, actor, full: bool = False, reason: str = "") -> Rollout:
    """Next step now (ends a pause, skips the rest of an analysis), or all the way with `full`; the
    reason, if given, goes in the timeline and the audit event."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_active(rollout, "promoted")
        if (level := frozen_by(locked.deployment)) is not None and not locked.rollback:
            raise Conflict(f"Rollout {locked.pk} is frozen by {level_text(level)} and continues by itself when "
                           f"{locked.deployment.name!r} leaves that level; abort is allowed meanwhile.")
        step = locked.current_step
        if not full and (step is None or "set_weight" in step):
            # Skipping a weight would send traffic the candidate was never warmed (or judged) for.
            raise Conflict(f"Rollout {locked.pk} is warming the candidate for its next weight and moves on by "
                           "itself once it is ready; promote ends a pause or an analysis (or use full).")
        before = snapshot(locked)
        target = len(locked.steps) if full else locked.step_index + 1
        add_timeline(locked, now, "promoted",
                     f"by {_who(actor)}" + (" (full)" if full else "") + (f": {reason}" if reason else ""))
        stop_quality_runs(locked)  # a quality step promoted past waits for no verdict
        enter_step(locked, target, now)
        locked.save()
        audit_record(actor=actor, action="rollout.promote", obj=locked, before=before,
                     after={**snapshot(locked), **({"reason": reason} if reason else {})})
        request_reconcile(locked.deployment)
    return locked


def rollout_abort(*, rollout: Rollout, actor, reason: str = "") -> Rollout:
    now = timezone.now()
    with transaction.atomic():
        locked = _locked_active(rollout, "aborted")
        before = snapshot(locked)
        abort(locked, now, f"aborted by {_who(actor)}" + (f": {reason}" if reason else ""))
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
        check_frozen(deployment, rollback=locked.rollback)
        _check_budget(deployment, rollback=locked.rollback, override_reason=override_reason)
        before = snapshot(locked)
        locked.finished_at = None
        locked.weight = 0
        locked.attempt += 1
        if override_reason:
            locked.override_reason = override_reason
        add_timeline(locked, now, "retried", f"by {_who(actor)}")
        enter_step(locked, 0, now)
        locked.save()
        resolve_abort_alerts(deployment, now)
        audit_record(actor=actor, action="rollout.retry", obj=locked, before=before, after=snapshot(locked))
        if override_reason and (exhausted := gate().exhausted_slos(deployment)):
            audit_record(actor=actor, action="rollout.budget_override", obj=locked,
                         after={"reason": override_reason, "exhausted": exhausted})
        request_reconcile(deployment)
    return locked


def rollout_set_auto_rollback(*, rollout: Rollout, actor, auto_rollback: bool) -> Rollout:
    """Turn the automatic rollback after success on or off, while the rollout runs or is watched."""
    now = timezone.now()
    with transaction.atomic():
        locked = _locked(rollout)
        if locked.rollback:
            raise Conflict(f"Rollout {locked.pk} is a rollback: rollbacks are never watched or rolled back by the "
                           "platform.")
        if not (locked.active or locked.in_watch(now)):
            raise Conflict(f"Rollout {locked.pk} is {locked.status} and its watch is over: automatic rollback is "
                           "turned on or off while a rollout runs or is watched after success.")
        if locked.auto_rollback == auto_rollback:
            return locked
        before = snapshot(locked)
        locked.auto_rollback = auto_rollback
        add_timeline(locked, now, f"auto-rollback {'on' if auto_rollback else 'off'}", f"by {_who(actor)}")
        locked.save(update_fields=["auto_rollback", "timeline", "updated_at"])
        audit_record(actor=actor, action="rollout.update", obj=locked, before=before, after=snapshot(locked))
    return locked


def undo_target(deployment: Deployment) -> Rollout | None:
    """The succeeded rollout that brought the deployment to what it serves now, if any."""
    last = (deployment.rollouts.filter(status=RolloutStatus.SUCCEEDED, candidate_version_id=deployment.version_id)
            .select_related("stable_version").order_by("-finished_at", "-id").first())
    return last if last is not None and last.candidate_engine_args == deployment.engine_args else None


def rejected_by_platform(rollback: Rollout) -> Rollout | None:
    """The rollout the platform rolled back during its watch by starting `rollback`, if that is what it is."""
    if not rollback.rollback:
        return None
    return Rollout.objects.filter(rolled_back_by=rollback).select_related("candidate_version").first()


def rollout_undo(*, deployment: Deployment, actor, reason: str = "", override_reason: str = "") -> Rollout:
    """Back to the previous spec: aborts a running rollout, else rolls back the last one that succeeded.

    The rollback is blue-green with no analysis: when the old set is still warm (a blue-green's
    scale-down delay) traffic moves on the next pass; otherwise the old spec is started at full
    size first and takes all traffic once ready.

    Undoing the platform's own rollback brings back the version it rejected: that is a new rollout
    like any other (the rejected one's strategy, steps and watch; budget policy, freeze and checks
    apply), and it needs a `reason`.
    """
    active = deployment.rollouts.filter(status__in=ACTIVE_ROLLOUT).first()
    if active is not None:
        return rollout_abort(rollout=active, actor=actor, reason=reason or "undo")
    deployment.refresh_from_db()
    last = undo_target(deployment)
    if last is None:
        raise Conflict(f"Nothing to undo: no succeeded rollout brought {deployment.name!r} to what it serves now.")
    rejected = rejected_by_platform(last)
    if rejected is not None:
        if not reason.strip():
            raise ValidationError({"reason": [
                f"Undo would redeploy v{rejected.candidate_version.number}, which the platform rolled back in "
                f"rollout {rejected.pk} ({rejected.message}). Say why it should serve again."]})
        return rollout_create(
            deployment=deployment, actor=actor, version=rejected.candidate_version.number,
            engine_args=rejected.candidate_engine_args, strategy=rejected.strategy,
            **_strategy_args(rejected), watch=rejected.watch_s, holdback=rejected.holdback_percent,
            promote_alias=rejected.promote_alias, override_reason=override_reason, redeploys=rejected,
            reason=reason.strip(),
        )
    return rollout_create(
        deployment=deployment, actor=actor, version=last.stable_version.number,
        engine_args=last.stable_engine_args, strategy=Strategy.BLUE_GREEN, rollback=True,
        promote_alias=last.promote_alias,
    )


def _strategy_args(rollout: Rollout) -> dict:
    """A rollout's normalised steps as rollout_create takes them, to run the same strategy again."""
    if rollout.strategy == Strategy.CANARY:
        return {"steps": rollout.steps}  # normalised steps read back as they are
    pauses = [step["pause"] for step in rollout.steps if "pause" in step]
    analyses = [step["analysis"] for step in rollout.steps if "analysis" in step]
    qualities = [step["quality"] for step in rollout.steps if "quality" in step]
    preview = None if not pauses else {} if pauses[0] is None else pauses[0]  # {}: until promoted
    return {"scale_down_delay": rollout.scale_down_delay_s, "preview": preview,
            "analysis": analyses[0] if analyses else None, "quality": qualities[0] if qualities else None}
