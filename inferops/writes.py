"""The audited create and update of one row that the apps' services share: validated, written and
recorded in the audit log in one transaction, so the row and its trail commit or roll back together."""

from __future__ import annotations

from django.db import IntegrityError, transaction

from inferops.api import Conflict
from inferops.audit import audit_record, snapshot


def create_audited(obj, *, actor, action: str, taken: str, also=None):
    """Validate `obj` and insert it with its audit event; a unique clash (a name already taken) is a
    Conflict saying `taken`. `also(obj)`, when given, writes what goes with the row in the same transaction."""
    obj.full_clean(validate_unique=False)
    try:
        with transaction.atomic():
            obj.save()
            if also is not None:
                also(obj)
            audit_record(actor=actor, action=action, obj=obj, after=snapshot(obj))
    except IntegrityError:
        raise Conflict(taken) from None
    return obj


def update_audited(obj, changes: dict, *, actor, action: str, adjust=None):
    """Lock `obj`'s row, set `changes`, validate, save and record before and after; the saved row.
    `adjust(locked, before)`, when given, runs after validation and before the save, and returns
    fields the audit event's `after` adds."""
    with transaction.atomic():
        locked = type(obj).objects.select_for_update().get(pk=obj.pk)
        before = snapshot(locked)
        for field, value in changes.items():
            setattr(locked, field, value)
        locked.full_clean(validate_unique=False)
        extra = adjust(locked, before) if adjust is not None else {}
        locked.save()
        audit_record(actor=actor, action=action, obj=locked, before=before, after={**snapshot(locked), **extra})
    return locked
