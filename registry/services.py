"""Registry operations. Each owns its transaction and records one audit event per write."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Max

from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.writes import create_audited, update_audited
from registry import checkpoint
from registry.models import Alias, ModelVersion, RegisteredModel


def model_create(*, name: str, task: str, actor, description: str = "", owner: str = "",
                 tags: list[str] | None = None) -> RegisteredModel:
    model = RegisteredModel(
        name=name, task=task, description=description, owner=owner, tags=tags or [],
        created_by=actor_or_none(actor),
    )
    return create_audited(model, actor=actor, action="model.create", taken=f"A model named {name!r} already exists.")


def model_update(*, model: RegisteredModel, actor, **changes) -> RegisteredModel:
    return update_audited(model, changes, actor=actor, action="model.update")


def version_register(*, model: RegisteredModel, artifact_uri: str, actor,
                     expected_sha256: str | None = None, description: str = "") -> ModelVersion:
    """Validate the checkpoint, digest it, and add it as the model's next version.

    Reading and hashing happen before the transaction: a multi-GB checkpoint must not hold a
    row lock for minutes. Any failure raises CheckpointError and stores nothing.
    """
    root = checkpoint.artifact_path(artifact_uri)
    facts = checkpoint.read_facts(root, task=model.task)
    manifest = checkpoint.artifact_manifest(root)
    digest = checkpoint.manifest_digest(manifest)
    if expected_sha256 and expected_sha256.lower() != digest:
        raise checkpoint.CheckpointError(
            f"digest mismatch: expected {expected_sha256.lower()}, the artifact's manifest digest "
            f"is {digest}; the checkpoint changed or the wrong directory was given.",
            field="sha256",
        )
    with transaction.atomic():
        # Locking the model row serialises concurrent registrations, so numbers never collide.
        RegisteredModel.objects.select_for_update().get(pk=model.pk)
        latest = model.versions.aggregate(latest=Max("number"))["latest"] or 0
        version = ModelVersion.objects.create(
            model=model, number=latest + 1, artifact_uri=artifact_uri, digest=digest,
            manifest=manifest, description=description,
            created_by=actor_or_none(actor),
            **facts.as_dict(),
        )
        audit_record(actor=actor, action="version.register", obj=version, after=snapshot(version))
    return version


def alias_set(*, model: RegisteredModel, name: str, version: ModelVersion, actor):
    """Point alias `name` at `version`; returns (alias, previous version or None)."""
    if version.model_id != model.pk:
        raise Conflict(f"Version {version.number} belongs to another model.")
    with transaction.atomic():
        RegisteredModel.objects.select_for_update().get(pk=model.pk)
        alias = Alias.objects.filter(model=model, name=name).select_related("version").first()
        previous = alias.version if alias else None
        before = snapshot(alias) if alias else None
        if alias is None:
            alias = Alias(model=model, name=name, version=version)
            alias.full_clean(validate_unique=False)
        alias.version = version
        alias.save()
        audit_record(actor=actor, action="alias.set", obj=alias, before=before,
                     after={**snapshot(alias), "version_number": version.number,
                            "previous_version_number": previous.number if previous else None})
    return alias, previous


def alias_delete(*, alias: Alias, actor) -> None:
    with transaction.atomic():
        before = {**snapshot(alias), "version_number": alias.version.number}
        audit_record(actor=actor, action="alias.delete", obj=alias, before=before)
        alias.delete()


def resolve_version(model: RegisteredModel, *, version: int | None, alias: str | None) -> ModelVersion:
    """The version a number or an alias names (deployments and rollouts pin one); a 400 naming the field
    when neither, both or an unknown one is given."""
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
