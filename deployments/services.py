"""Deployment operations: create, update (scale, change version, pause), delete.

Each validates everything before writing, owns its transaction, records an audit event and
asks the reconcile loop to act on commit. The loop does the slow work; these return at once.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments import engine_args as engine_args_mod
from deployments import gpus
from deployments.choices import ACTIVE_ROLLOUT, Backend, DeploymentStatus, DriverName
from deployments.models import Deployment
from inferops.api import Conflict
from inferops.audit import audit_record, snapshot
from inferops.celery import enqueue
from registry.models import Alias, ModelVersion, RegisteredModel
from runtime.gateway.contract import PREVIEW_SUFFIX

# A reconcile request older than this is dropped: beat starts a pass every couple of seconds anyway.
RECONCILE_TASK_EXPIRES_S = 30
RESOURCE_KEYS = {"gpu_type": str, "gpu_count": int, "cpu": (int, float, str), "memory": str}


def resolve_version(model: RegisteredModel, *, version: int | None, alias: str | None) -> ModelVersion:
    if version is not None and alias:
        raise ValidationError({"version": ["Give either version or alias, not both."]})
    if alias:
        found = Alias.objects.select_related("version").filter(model=model, name=alias).first()
        if found is None:
            raise ValidationError({"alias": [f"Model {model.name!r} has no alias {alias!r}."]})
        return found.version
    if version is None:
        raise ValidationError({"version": ["Give the version number or an alias to deploy."]})
    found = model.versions.filter(number=version).first()
    if found is None:
        raise ValidationError({"version": [f"Model {model.name!r} has no version {version}."]})
    return found


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
        from deployments.drivers.local import vllm_missing  # the driver knows where vLLM lives

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


def deployment_create(*, name: str, model: RegisteredModel, actor, version: int | None = None,
                      alias: str | None = None, backend: str = Backend.BUILTIN,
                      driver: str = DriverName.LOCAL, replicas: int = 1, min_replicas: int | None = None,
                      max_replicas: int | None = None, autoscale: bool = False,
                      engine_args: dict | None = None, resources: dict | None = None) -> Deployment:
    if name.endswith(PREVIEW_SUFFIX):
        raise ValidationError({"name": [f"Names ending in {PREVIEW_SUFFIX!r} are reserved for rollout previews."]})
    pinned = resolve_version(model, version=version, alias=alias)
    min_replicas = replicas if min_replicas is None else min_replicas
    max_replicas = max(replicas, min_replicas) if max_replicas is None else max_replicas
    validate_sizes(replicas, min_replicas, max_replicas)
    deployment = Deployment(
        name=name, model=model, version=pinned, alias=alias or "", backend=backend, driver=driver,
        replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas, autoscale=autoscale,
        engine_args=validate_engine_args(backend, engine_args or {}),
        resources=validate_resources(resources or {}),
        created_by=actor if getattr(actor, "pk", None) else None,
    )
    validate_runnable(version=pinned, backend=backend, driver=driver, engine_args=deployment.engine_args,
                      resources=deployment.resources)
    deployment.full_clean(validate_unique=False)
    try:
        with transaction.atomic():
            deployment.save()
            audit_record(actor=actor, action="deployment.create", obj=deployment, after=snapshot(deployment))
            request_reconcile(deployment)
    except IntegrityError:
        raise Conflict(f"A deployment named {name!r} already exists.") from None
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
        if version is not None or alias:
            locked.version = resolve_version(locked.model, version=version, alias=alias)
            locked.alias = alias or ""
        if "engine_args" in changes:
            changes["engine_args"] = validate_engine_args(locked.backend, changes["engine_args"])
        if "resources" in changes:
            changes["resources"] = validate_resources(changes["resources"])
        for field, value in changes.items():
            setattr(locked, field, value)
        if "replicas" in changes and "min_replicas" not in changes and locked.replicas < locked.min_replicas:
            locked.min_replicas = locked.replicas  # an explicit scale-down moves the floor with it
        if "replicas" in changes and "max_replicas" not in changes and locked.replicas > locked.max_replicas:
            locked.max_replicas = locked.replicas
        validate_sizes(locked.replicas, locked.min_replicas, locked.max_replicas)
        if changes_spec or "resources" in changes:
            validate_runnable(version=locked.version, backend=locked.backend, driver=locked.driver,
                              engine_args=locked.engine_args, resources=locked.resources)
        if locked.status == DeploymentStatus.READY and (version is not None or alias or "replicas" in changes):
            locked.status = DeploymentStatus.PROGRESSING
        locked.full_clean(validate_unique=False)
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
