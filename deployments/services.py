"""Deployment operations: create, update (scale, change version, pause), delete.

Each validates everything before writing, owns its transaction, records an audit event and
asks the reconcile loop to act on commit. The loop does the slow work; these return at once.
"""

from __future__ import annotations

from functools import partial

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments import engine_args as engine_args_mod
from deployments import gpus
from deployments.choices import ACTIVE_ROLLOUT, Backend, DeploymentStatus, DriverName
from deployments.models import Deployment
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.celery import enqueue
from inferops.validators import Problems
from registry.models import ModelVersion, RegisteredModel
from registry.services import resolve_version
from runtime.gateway.contract import PREVIEW_SUFFIX

# A reconcile request older than this is dropped: beat starts a pass every couple of seconds anyway.
RECONCILE_TASK_EXPIRES_S = 30
RESOURCE_KEYS = {"gpu_type": str, "gpu_count": int, "cpu": (int, float, str), "memory": str}


def validate_resources(resources) -> dict:
    if not isinstance(resources, dict):
        raise ValidationError({"resources": ["Must be an object, e.g. {\"gpu_type\": \"nvidia-h100\"}."]})
    errors = []
    for key, value in resources.items():
        expected = RESOURCE_KEYS.get(key)
        if expected is None:
            errors.append(f"{key}: unknown; accepted: {', '.join(RESOURCE_KEYS)}")
        elif not isinstance(value, expected) or isinstance(value, bool):
            errors.append(f"{key}: wrong type")
        elif key == "gpu_count" and value < 0:
            errors.append("gpu_count: must be >= 0")
    if errors:
        raise ValidationError({"resources": errors})
    return resources


def validate_sizes(replicas: int, min_replicas: int, max_replicas: int) -> None:
    if min_replicas > max_replicas:
        message = f"min_replicas ({min_replicas}) exceeds max_replicas ({max_replicas})."
        raise ValidationError({"min_replicas": [message]})
    if not min_replicas <= replicas <= max_replicas:
        raise ValidationError({"replicas": [
            f"replicas ({replicas}) must lie between min_replicas ({min_replicas}) and max_replicas ({max_replicas})."
        ]})


def validate_engine_args(backend: str, engine_args) -> dict:
    try:
        return engine_args_mod.validate(backend, engine_args)
    except engine_args_mod.EngineArgsError as exc:
        raise ValidationError({"engine_args": [f"{k}: {v}" for k, v in exc.errors.items()]}) from None


def validate_runnable(*, version: ModelVersion, backend: str, driver: str, engine_args: dict,
                      resources: dict) -> None:
    """Refuse what could never start: no vLLM for the local driver, a tensor-parallel size other
    than the GPU count, a version that does not fit its GPUs' memory."""
    errors = gpus.check(version=version, backend=backend, engine_args=engine_args, resources=resources)
    if backend == Backend.VLLM and driver == DriverName.LOCAL:
        from deployments.replicas.drivers.local import vllm_missing  # the driver knows where vLLM lives

        if missing := vllm_missing():
            errors["backend"] = [missing[0].upper() + missing[1:] + "."]
    if errors:
        raise ValidationError(errors)


def frozen_by(deployment: Deployment) -> dict | None:
    """The deployment's degradation level in force when it freezes rollouts, else None."""
    degradation = deployment.degradation or {}
    return degradation if degradation.get("freeze_rollouts") else None


def level_text(degradation: dict) -> str:
    name = degradation.get("name")
    return f"degradation level {degradation.get('level')}" + (f" ({name})" if name else "")


def check_frozen(deployment: Deployment, *, rollback: bool, refused: str = "new rollouts are refused") -> None:
    level = None if rollback else frozen_by(deployment)
    if level is not None:
        raise Conflict(
            f"Deployment {deployment.name!r} is at {level_text(level)}, which freezes rollouts: {refused} "
            "until it leaves that level. A rollback (\"rollback\": true, or the undo action) is allowed; to go "
            f"ahead anyway, force a lower level first (POST /api/v1/deployments/{deployment.name}/degradation/"
            "override/, audited)."
        )


def request_reconcile(deployment: Deployment) -> None:
    """A reconcile pass soon after the transaction commits (by name: deployments.tasks imports the
    reconcile loop, which imports the rollout machine and through it these services' models)."""
    transaction.on_commit(lambda: enqueue("deployments.reconcile_deployment", deployment.pk,
                                          expires=RECONCILE_TASK_EXPIRES_S))


def check_name(name: str) -> None:
    if name.endswith(PREVIEW_SUFFIX):
        raise ValidationError({"name": [f"Names ending in {PREVIEW_SUFFIX!r} are reserved for rollout previews."]})


def taken_text(name: str) -> str:
    return f"A deployment named {name!r} already exists."


def deployment_build(*, name: str = "", model: RegisteredModel | None = None, version: int | None = None,
                     alias: str | None = None, backend: str = Backend.BUILTIN, driver: str = DriverName.LOCAL,
                     replicas: int = 1, min_replicas: int | None = None, max_replicas: int | None = None,
                     autoscale: bool = False, engine_args: dict | None = None, resources: dict | None = None,
                     refused: frozenset | set = frozenset()) -> Deployment:
    """The deployment these would create, unsaved, after every check in one pass: one ValidationError
    names all the problems (a taken name among them; a taken name alone is a Conflict). `refused`:
    fields the caller could not read (a console form's bad input), whose checks are skipped."""
    def known(*fields) -> bool:
        return not refused.intersection(fields)

    problems = Problems()
    if known("name"):
        problems.check(check_name, name)
    pinned = None
    if model is not None and known("model", "version", "alias"):
        pinned = problems.check(resolve_version, model, version=version, alias=alias)
    if known("replicas", "min_replicas", "max_replicas"):
        min_replicas = replicas if min_replicas is None else min_replicas
        max_replicas = max(replicas, min_replicas) if max_replicas is None else max_replicas
        problems.check(validate_sizes, replicas, min_replicas, max_replicas)
    engine_args = problems.check(validate_engine_args, backend, engine_args or {}) if known(
        "backend", "engine_args") else None
    resources = problems.check(validate_resources, resources or {}) if known("resources") else None
    if None not in (pinned, engine_args, resources) and known("driver"):
        problems.check(validate_runnable, version=pinned, backend=backend, driver=driver, engine_args=engine_args,
                       resources=resources)
    deployment = Deployment(
        name=name, model=model, version=pinned, alias=alias or "", backend=backend, driver=driver,
        replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas, autoscale=autoscale,
        engine_args=engine_args, resources=resources)
    if not problems.errors and not refused:  # the model's own field checks, on a complete row
        problems.check(deployment.full_clean, validate_unique=False)
    taken = known("name") and bool(name) and Deployment.objects.filter(name=name).exists()
    if taken and problems.errors:
        problems.errors.setdefault("name", []).append(taken_text(name))
    problems.raise_any()
    if taken:
        raise Conflict(taken_text(name))
    return deployment


def deployment_create(*, name: str, model: RegisteredModel, actor, **spec) -> Deployment:
    deployment = deployment_build(name=name, model=model, **spec)
    deployment.created_by = actor_or_none(actor)
    try:
        with transaction.atomic():
            deployment.save()
            audit_record(actor=actor, action="deployment.create", obj=deployment, after=snapshot(deployment))
            request_reconcile(deployment)
    except IntegrityError:  # taken since the check
        raise Conflict(taken_text(name)) from None
    return deployment


def apply_changes(deployment: Deployment, *, version: int | None = None, alias: str | None = None,
                  refused: frozenset | set = frozenset(), **changes) -> Deployment:
    """Set the changes on `deployment` (not saved) after every check in one pass: one ValidationError
    names all the problems. `refused`: fields the caller could not read, whose checks are skipped."""
    def known(*fields) -> bool:
        return not refused.intersection(fields)

    problems = Problems()
    spec_known = known("version", "alias", "engine_args", "resources")
    if (version is not None or alias) and known("version", "alias"):
        if (pinned := problems.check(resolve_version, deployment.model, version=version, alias=alias)) is None:
            spec_known = False
        else:
            deployment.version, deployment.alias = pinned, alias or ""
    spec_changed = version is not None or alias or "engine_args" in changes or "resources" in changes
    for field, check in (("engine_args", partial(validate_engine_args, deployment.backend)),
                         ("resources", validate_resources)):
        if field in changes:
            checked = problems.check(check, changes.pop(field))
            if checked is None:
                spec_known = False
            else:
                setattr(deployment, field, checked)
    for field, value in changes.items():
        setattr(deployment, field, value)
    if "replicas" in changes and "min_replicas" not in changes and deployment.replicas < deployment.min_replicas:
        deployment.min_replicas = deployment.replicas  # an explicit scale-down moves the floor with it
    if "replicas" in changes and "max_replicas" not in changes and deployment.replicas > deployment.max_replicas:
        deployment.max_replicas = deployment.replicas
    if known("replicas", "min_replicas", "max_replicas"):
        problems.check(validate_sizes, deployment.replicas, deployment.min_replicas, deployment.max_replicas)
    if spec_known and spec_changed:
        problems.check(validate_runnable, version=deployment.version, backend=deployment.backend,
                       driver=deployment.driver, engine_args=deployment.engine_args, resources=deployment.resources)
    if not problems.errors and not refused:
        problems.check(deployment.full_clean, validate_unique=False)
    problems.raise_any()
    return deployment


def deployment_update(*, deployment: Deployment, actor, version: int | None = None, alias: str | None = None,
                      **changes) -> Deployment:
    """Scale, change version (number or alias: pinned now), engine args, autoscaling or pause."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().select_related("model").get(pk=deployment.pk)
        if locked.deleted_at:
            raise Conflict(f"Deployment {locked.name!r} is being deleted.")
        before = snapshot(locked)
        changes_spec = version is not None or alias or "engine_args" in changes
        active = locked.rollouts.filter(status__in=ACTIVE_ROLLOUT).first() if changes_spec else None
        if active is not None:
            raise Conflict(f"Rollout {active.pk} of {locked.name!r} is {active.status}: the version and engine "
                           "args change through it (promote or abort it first).")
        if changes_spec:  # a direct change of version is a rollout without the analysis
            check_frozen(locked, rollback=False, refused="version and engine-args changes are refused")
        apply_changes(locked, version=version, alias=alias, **changes)
        if locked.status == DeploymentStatus.READY and (version is not None or alias or "replicas" in changes):
            locked.status = DeploymentStatus.PROGRESSING
        locked.save()
        audit_record(actor=actor, action="deployment.update", obj=locked, before=before, after=snapshot(locked))
        request_reconcile(locked)
    return locked


def deployment_delete(*, deployment: Deployment, actor) -> Deployment:
    """Mark for deletion; the reconcile loop drains every replica, then removes the row."""
    with transaction.atomic():
        locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
        if locked.deleted_at is None:
            before = snapshot(locked)
            locked.deleted_at = timezone.now()
            locked.status = DeploymentStatus.DELETING
            locked.save(update_fields=["deleted_at", "status", "updated_at"])
            audit_record(actor=actor, action="deployment.delete", obj=locked, before=before)
            request_reconcile(locked)
    return locked


def deployment_set_degradation(*, deployment: Deployment, actions: dict | None) -> None:
    """Put a degradation level's actions in force (None: level 0). The next reconcile pass
    publishes them in the routing table; the caller records why (degradation.services)."""
    Deployment.objects.filter(pk=deployment.pk).update(degradation=actions, updated_at=timezone.now())
    deployment.degradation = actions
    request_reconcile(deployment)
