import json
import uuid

from django.conf import settings
from django.db import IntegrityError, models, transaction


class Installation(models.Model):
    """This installation's identity: one row, made on first use, kept with the data.

    Anything this installation leaves outside its database (a replica process's marker, a
    Kubernetes object's label) carries it, so that two installations on one machine, cluster or
    Redis never take each other's things for their own. Made on first use rather than by a data
    migration: a transactional test's flush empties the table, and the row must come back.
    """

    SINGLETON = 1

    id = models.PositiveSmallIntegerField(primary_key=True, default=SINGLETON, editable=False)
    uuid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(id=1), name="one_installation")]

    def __str__(self) -> str:
        return str(self.uuid)


def installation_id() -> str:
    """This installation's id (a UUID string), made the first time anything asks."""
    row = Installation.objects.filter(pk=Installation.SINGLETON).first()
    if row is None:
        try:
            with transaction.atomic():
                row = Installation.objects.create(pk=Installation.SINGLETON)
        except IntegrityError:  # another process made it first
            row = Installation.objects.get(pk=Installation.SINGLETON)
    return str(row.uuid)


class AuditEvent(models.Model):
    """One row per write anywhere in the control plane: who did what to which object."""

    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too, so the trail still reads right after the user is deleted.
    actor_name = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    object_type = models.CharField(max_length=64)
    object_id = models.CharField(max_length=128)
    object_repr = models.CharField(max_length=255)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        db_table = "registry_auditevent"  # made by the registry app, before the audit log moved here
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.actor_name} {self.action} {self.object_repr}"

    def changes(self) -> list[tuple[str, str, str]]:
        """(field, before, after) for every field the write changed, values as a person reads them;
        a create has only afters, a delete only befores (shown as "—"). A field that is empty on the
        one side it has (a create's unset options) changed nothing a person needs to read."""
        before, after = self.before or {}, self.after or {}
        if not isinstance(before, dict) or not isinstance(after, dict):
            return [("", readable(self.before), readable(self.after))]
        fields = [*before, *(key for key in after if key not in before)]
        return [(field, readable(before.get(field)), readable(after.get(field)))
                for field in fields if changed(before, after, field)]


class Created(models.Model):
    """Who made a row and when (the console shows both; the audit log has the rest)."""

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        abstract = True


class Authored(Created):
    """A row people change: made by whom and when, and last changed when."""

    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True


def empty(value) -> bool:
    return value is None or value == "" or value == [] or value == {}


def changed(before: dict, after: dict, field: str) -> bool:
    if field in before and field in after:
        return before[field] != after[field]
    return not empty(before.get(field, after.get(field)))


def readable(value) -> str:
    """A JSON value as one line a person reads: text unquoted, empty as "—", nested values as JSON."""
    if empty(value):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str | int | float):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str | int | float) for item in value):
        return ", ".join(str(item) for item in value)
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), ensure_ascii=False)
