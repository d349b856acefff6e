"""Tenant and API-key operations. Each validates before writing, owns its transaction, records
one audit event (never with the key's secret or hash) and republishes the key table on commit."""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments.models import Deployment
from inferops.audit import actor_or_none, audit_record, snapshot
from inferops.writes import create_audited, update_audited
from runtime.gateway.contract import hash_api_key
from tenants import models as tenant_models
from tenants.models import ApiKey, Tenant
from tenants.publish import publish_on_commit

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_concurrent")
TENANT_FIELDS = ("display_name", *LIMIT_FIELDS)
# Attempts at a fresh random prefix: 8 hex characters collide rarely, but they can.
PREFIX_ATTEMPTS = 5


def key_snapshot(key: ApiKey) -> dict:
    """What the audit log keeps of a key: everything but the hash."""
    data = snapshot(key)
    data.pop("key_hash", None)
    return data


def tenant_create(*, name: str, actor, display_name: str = "", rpm_limit: int | None = None,
                  tpm_limit: int | None = None, max_concurrent: int | None = None) -> Tenant:
    tenant = Tenant(name=name, display_name=display_name, rpm_limit=rpm_limit, tpm_limit=tpm_limit,
                    max_concurrent=max_concurrent, created_by=actor_or_none(actor))
    return create_audited(tenant, actor=actor, action="tenant.create",
                          taken=f"A tenant named {name!r} already exists.")


def tenant_update(*, tenant: Tenant, actor, **changes) -> Tenant:
    unknown = set(changes) - set(TENANT_FIELDS)
    if unknown:
        raise ValidationError({field: ["Not a field that can be changed."] for field in sorted(unknown)})
    locked = update_audited(tenant, changes, actor=actor, action="tenant.update")
    if any(field in LIMIT_FIELDS for field in changes):
        publish_on_commit()
    return locked


def validate_deployments(names) -> list[str]:
    """Deployment names a key is scoped to: each must exist (and not be on its way out)."""
    names = list(dict.fromkeys(names or []))
    known = set(Deployment.objects.filter(name__in=names, deleted_at__isnull=True).values_list("name", flat=True))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValidationError({"deployments": [f"No deployment named {', '.join(map(repr, unknown))}."]})
    return names


def validate_expiry(expires_at: datetime | None) -> None:
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": ["Must lie in the future."]})


def key_create(*, tenant: Tenant, name: str, actor, deployments=(), rpm_limit: int | None = None,
               tpm_limit: int | None = None, max_concurrent: int | None = None, priority: int = 0,
               expires_at: datetime | None = None) -> tuple[ApiKey, str]:
    """Create a key; returns (key, full secret key). The secret exists only in the return value."""
    validate_expiry(expires_at)
    scope = validate_deployments(deployments)
    key = ApiKey(tenant=tenant, name=name, deployments=scope, rpm_limit=rpm_limit, tpm_limit=tpm_limit,
                 max_concurrent=max_concurrent, priority=priority, expires_at=expires_at,
                 created_by=actor_or_none(actor), prefix="0" * tenant_models.KEY_PREFIX_LENGTH, key_hash="0" * 64)
    key.full_clean(exclude=["prefix", "key_hash"], validate_unique=False)
    with transaction.atomic():
        for attempt in range(PREFIX_ATTEMPTS):
            key.prefix = tenant_models.new_prefix()
            secret = tenant_models.new_key(key.prefix)
            key.key_hash = hash_api_key(secret)
            try:
                with transaction.atomic():  # a savepoint: a prefix collision leaves the outer transaction usable
                    key.save()
                break
            except IntegrityError:
                if attempt == PREFIX_ATTEMPTS - 1:
                    raise
        audit_record(actor=actor, action="apikey.create", obj=key, after=key_snapshot(key))
        publish_on_commit()
    return key, secret


def key_revoke(*, key: ApiKey, actor) -> ApiKey:
    """Revoke at once: the key leaves the published table on commit. Revoking twice is a no-op."""
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().select_related("tenant").get(pk=key.pk)
        if locked.revoked_at is None:
            before = key_snapshot(locked)
            locked.revoked_at = timezone.now()
            locked.revoked_by = actor_or_none(actor)
            locked.save(update_fields=["revoked_at", "revoked_by"])
            audit_record(actor=actor, action="apikey.revoke", obj=locked, before=before, after=key_snapshot(locked))
            publish_on_commit()
    return locked
