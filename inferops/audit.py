"""The audit log: one AuditEvent row per write anywhere in the control plane.

Services call `audit_record` inside the transaction of the write they record, with `snapshot`s of
the object before and after, so the trail and the change commit or roll back together.
"""

from __future__ import annotations

import json

from django.core.serializers.json import DjangoJSONEncoder
from django.forms.models import model_to_dict

from inferops.models import AuditEvent

# Left out of snapshots: bulky, and already fixed by what is kept (a version's digest).
SNAPSHOT_EXCLUDE = {"manifest"}


def actor_or_none(actor):
    """The user to store as who did something, or None for the system, a script or an anonymous caller."""
    return actor if getattr(actor, "pk", None) else None


def snapshot(obj) -> dict:
    data = model_to_dict(obj, exclude=list(SNAPSHOT_EXCLUDE))
    # A many-to-many field comes as its rows; the trail keeps their keys, as it does a foreign key's.
    for field in obj._meta.many_to_many:
        if field.name in data:
            data[field.name] = sorted(related.pk for related in data[field.name])
    return json.loads(json.dumps(data, cls=DjangoJSONEncoder))


def audit_record(*, actor, action: str, obj, before: dict | None = None, after: dict | None = None) -> AuditEvent:
    return AuditEvent.objects.create(
        actor=actor_or_none(actor),
        actor_name=getattr(actor, "username", None) or "system",
        action=action,
        object_type=obj._meta.label_lower,
        object_id=str(obj.pk),
        object_repr=str(obj)[:255],
        before=before,
        after=after,
    )
