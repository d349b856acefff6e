"""Eval runs: start one (every field checked before anything is written), cancel one, and read the
latest scores other apps show (a version's page, a rollout's quality step, degradation's fallback).

A run is a row; the Celery task "evals.execute_run" does the work (evals/runs/runner.py), enqueued
once the row is committed.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from deployments.choices import ACTIVE_ROLLOUT
from deployments.models import Deployment, Rollout
from evals.choices import FINISHED_RUN, RunStatus, Scorer, TargetKind, Trigger
from evals.models import EvalRun, EvalSet, EvalSetVersion
from evals.signals import run_finished
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.celery import enqueue
from inferops.validators import Problems
from registry.models import ModelVersion

EXECUTE_TASK = "evals.execute_run"
# The engine's priority range, as tenants.models.PRIORITY_RANGE says (evals sits below tenants in the
# layers, so it cannot import it). An eval yields to every interactive request by default.
PRIORITY_RANGE = (-1000, 1000)
LOWEST_PRIORITY = PRIORITY_RANGE[0]
CONCURRENCY_RANGE = (1, 32)
DEFAULT_CONCURRENCY = 4
TARGET_SHAPES = ('{"deployment": NAME}, {"model": NAME, "version": N} or {"rollout": ID, "track": "canary"}')
ROLLOUT_TRACKS = ("canary",)


def _target_error(message: str) -> ValidationError:
    return ValidationError({"target": [message]})


def _integer(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _target_error(f"{what} must be an integer, not {value!r}.")
    return value


def _deployment_target(target: dict) -> dict:
    name = target["deployment"]
    if not isinstance(name, str):
        raise _target_error(f"deployment must be a deployment's name, not {name!r}.")
    deployment = Deployment.objects.select_related("version").filter(name=name, deleted_at__isnull=True).first()
    if deployment is None:
        raise _target_error(f"No deployment named {name!r}.")
    return {"target_kind": TargetKind.DEPLOYMENT, "deployment": deployment, "deployment_name": deployment.name,
            "model_version": deployment.version, "engine_args": deployment.engine_args}


def _version_target(target: dict) -> dict:
    if "version" not in target:
        raise _target_error("A model target needs its version: {\"model\": NAME, \"version\": N}.")
    name, number = target["model"], _integer(target["version"], "version")
    version = ModelVersion.objects.select_related("model").filter(model__name=name, number=number).first()
    if version is None:
        from registry.models import RegisteredModel

        known = RegisteredModel.objects.filter(name=name).exists() if isinstance(name, str) else False
        raise _target_error(f"Model {name!r} has no version {number}." if known else f"No model named {name!r}.")
    return {"target_kind": TargetKind.VERSION, "model_version": version, "engine_args": {}}


def _rollout_target(target: dict) -> dict:
    rollout_id = _integer(target["rollout"], "rollout")
    track = target.get("track", "canary")
    if track not in ROLLOUT_TRACKS:
        raise _target_error(f"track must be \"canary\" (the rollout's candidate), not {track!r}.")
    rollout = (Rollout.objects.select_related("deployment", "candidate_version")
               .filter(pk=rollout_id).first())
    if rollout is None:
        raise _target_error(f"No rollout {rollout_id}.")
    # An active rollout always keeps candidate replicas started (rollouts/machine.candidate_size).
    if rollout.status not in ACTIVE_ROLLOUT:
        raise _target_error(f"Rollout {rollout_id} is {rollout.status}: only a running or paused rollout has a "
                            "candidate to score.")
    return {"target_kind": TargetKind.ROLLOUT, "deployment": rollout.deployment,
            "deployment_name": rollout.deployment.name, "model_version": rollout.candidate_version,
            "engine_args": rollout.candidate_engine_args, "rollout": rollout, "track": track}


def resolve_target(target) -> dict:
    """The run's target fields from one of the three shapes; a ValidationError on `target` otherwise."""
    if not isinstance(target, dict):
        raise _target_error(f"Must be an object: {TARGET_SHAPES}.")
    kinds = [key for key in ("deployment", "model", "rollout") if key in target]
    if len(kinds) != 1:
        raise _target_error(f"Give exactly one of deployment, model or rollout: {TARGET_SHAPES}.")
    allowed = {"deployment": {"deployment"}, "model": {"model", "version"}, "rollout": {"rollout", "track"}}[kinds[0]]
    unknown = sorted(set(target) - allowed)
    if unknown:
        raise _target_error(f"Unknown key(s) {', '.join(unknown)} for a {kinds[0]} target: {TARGET_SHAPES}.")
    return {"deployment": _deployment_target, "model": _version_target, "rollout": _rollout_target}[kinds[0]](target)


def resolve_set_version(eval_set: EvalSet, set_version: EvalSetVersion | None) -> EvalSetVersion:
    if set_version is None:
        latest = eval_set.latest_version()
        if latest is None:
            raise ValidationError({"set_version": [
                f"Eval set {eval_set.name!r} has no version yet: upload its cases first."]})
        return latest
    if set_version.eval_set_id != eval_set.pk:
        raise ValidationError({"set_version": [f"{set_version} is not a version of eval set {eval_set.name!r}."]})
    return set_version


def uses_parity(set_version: EvalSetVersion) -> bool:
    return any(case.get("scorer") == Scorer.PARITY for case in set_version.items)


def check_priority(priority: int | None) -> int:
    if priority is None:
        return LOWEST_PRIORITY
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise ValidationError({"priority": [f"Must be an integer from {low} to {high} (higher is served first)."]})
    return priority


def check_concurrency(concurrency: int | None) -> int:
    if concurrency is None:
        return DEFAULT_CONCURRENCY
    low, high = CONCURRENCY_RANGE
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not low <= concurrency <= high:
        raise ValidationError({"concurrency": [f"Must be an integer from {low} to {high} (requests at once)."]})
    return concurrency


def run_create(*, eval_set: EvalSet, actor, target: dict, set_version: EvalSetVersion | None = None,
               reference: ModelVersion | None = None, priority: int | None = None,
               concurrency: int | None = None, trigger: str = Trigger.API) -> EvalRun:
    """Check every field (one ValidationError naming each bad one), create the queued run and enqueue
    its task once the row is committed."""
    problems = Problems()
    version = problems.check(resolve_set_version, eval_set, set_version)
    fields = problems.check(resolve_target, target)
    priority = problems.check(check_priority, priority)
    concurrency = problems.check(check_concurrency, concurrency)
    if version is not None and reference is None and uses_parity(version):
        problems.add(ValidationError({"reference": [
            f"{version} has parity cases, which compare with a reference version's output: give "
            "reference {\"model\": NAME, \"version\": N}."]}))
    if trigger not in Trigger.values:
        problems.add(ValidationError({"trigger": [f"One of: {', '.join(Trigger.values)}."]}))
    problems.raise_any()
    with transaction.atomic():
        run = EvalRun.objects.create(
            eval_set=eval_set, set_version=version, reference_version=reference, priority=priority,
            concurrency=concurrency, trigger=trigger, total=version.case_count or len(version.items),
            created_by=actor_or_none(actor), **fields,
        )
        audit_record(actor=actor, action="eval_run.create", obj=run, after=snapshot(run))
        transaction.on_commit(lambda: enqueue(EXECUTE_TASK, run.pk))
    return run


def run_cancel(*, run: EvalRun, actor) -> EvalRun:
    """A queued run is cancelled at once; a running one is asked to stop, and its runner stops between
    cases, keeping the cases done. A finished run is a Conflict."""
    with transaction.atomic():
        locked = EvalRun.objects.select_for_update().get(pk=run.pk)
        if locked.status in FINISHED_RUN:
            raise Conflict(f"Eval run {locked.pk} is {locked.status}; only a queued or running run can be cancelled.")
        before = snapshot(locked)
        if locked.status == RunStatus.QUEUED:
            locked.status, locked.finished_at = RunStatus.CANCELLED, timezone.now()
            locked.error = f"Cancelled by {getattr(actor, 'username', None) or 'the system'} before it started."
        locked.cancel_requested = True
        locked.save(update_fields=["status", "finished_at", "error", "cancel_requested", "updated_at"])
        audit_record(actor=actor, action="eval_run.cancel", obj=locked, before=before, after=snapshot(locked))
        if locked.status == RunStatus.CANCELLED:
            send_finished_on_commit(locked)
    return locked


def send_finished_on_commit(run: EvalRun) -> None:
    """run_finished once the run's final row is committed (receivers read it, maybe from other processes)."""
    transaction.on_commit(lambda: run_finished.send_robust(sender=EvalRun, run=run))


def latest_run(*, model_version: ModelVersion, set_version: EvalSetVersion | None = None,
               eval_set: EvalSet | None = None) -> EvalRun | None:
    """The latest succeeded run of model_version, on that set version or eval set when given."""
    runs = EvalRun.objects.filter(model_version=model_version, status=RunStatus.SUCCEEDED)
    if set_version is not None:
        runs = runs.filter(set_version=set_version)
    if eval_set is not None:
        runs = runs.filter(eval_set=eval_set)
    return runs.select_related("eval_set", "set_version").order_by("-finished_at", "-id").first()


def deployment_score(deployment: Deployment, eval_set: EvalSet | None = None) -> EvalRun | None:
    """The latest succeeded run of the version the deployment serves now, on any eval set or on that one."""
    return latest_run(model_version=deployment.version, eval_set=eval_set)
