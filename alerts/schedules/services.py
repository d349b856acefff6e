"""On-call schedules: who is on call at an instant, when that next changes, the timeline between
two instants, and the services that write schedules and overrides.

A layer hands off at the local wall-clock time of its `starts_at` in the schedule's time zone, so
a 09:00 Europe/Berlin hand-off stays 09:00 when the clocks change (a day is then 23 or 25 hours).
Shift k starts at `starts_at`'s local time plus k days (or weeks); its member is k modulo the
number of members. Above the layers, an override covering the instant wins (the latest created
one if several overlap).
"""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Prefetch

from alerts.choices import Rotation
from alerts.models import EscalationStep, LayerMember, Schedule, ScheduleLayer, ScheduleOverride
from inferops.api import Conflict
from inferops.audit import actor_or_none, audit_record, snapshot

PERIOD = {Rotation.DAILY: timedelta(days=1), Rotation.WEEKLY: timedelta(days=7)}
NEXT_CHANGE_HORIZON = timedelta(days=60)
OVERRIDE = "override"
LAYER_FIELDS = ("name", "rotation", "starts_at", "ends_at", "users")


def time_zone(name: str) -> zoneinfo.ZoneInfo:
    """The zone, or ValidationError on `time_zone` (zoneinfo also refuses paths like '../x')."""
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise ValidationError({"time_zone": [f"{name!r} is not a time zone known to the tz database "
                                             f"(e.g. 'UTC', 'Europe/Berlin', 'America/New_York')."]}) from None


@dataclass(frozen=True)
class Layer:
    """A layer as the computation needs it: the members in rotation order."""

    number: int  # position + 1, as people count layers
    period: timedelta
    anchor: datetime  # starts_at as local wall-clock time (naive)
    zone: zoneinfo.ZoneInfo
    starts_at: datetime
    ends_at: datetime | None
    members: tuple

    @property
    def source(self) -> str:
        return f"layer {self.number}"

    def handoff(self, shift: int) -> datetime:
        """When shift `shift` starts, in UTC (the local time of starts_at, `shift` periods on)."""
        return (self.anchor + shift * self.period).replace(tzinfo=self.zone).astimezone(UTC)

    def shift_at(self, at: datetime) -> int:
        """The number of completed shifts at `at` (at or after starts_at)."""
        local = at.astimezone(self.zone).replace(tzinfo=None)
        shift = (local - self.anchor) // self.period
        # The wall-clock estimate can be one off around a DST change: settle it on UTC instants.
        while self.handoff(shift + 1) <= at:
            shift += 1
        while shift > 0 and self.handoff(shift) > at:
            shift -= 1
        return shift

    def covers(self, at: datetime) -> bool:
        return bool(self.members) and self.starts_at <= at and (self.ends_at is None or at < self.ends_at)

    def member_at(self, at: datetime):
        return self.members[self.shift_at(at) % len(self.members)]

    def changes(self, after: datetime, until: datetime) -> list[datetime]:
        """Instants in (after, until] where this layer's member may change."""
        moments = [t for t in (self.starts_at, self.ends_at) if t is not None and after < t <= until]
        if not self.members:
            return moments
        first = self.shift_at(max(after, self.starts_at)) + 1
        end = min(until, self.ends_at) if self.ends_at else until
        shift = first
        while (moment := self.handoff(shift)) <= end:
            if moment > after:
                moments.append(moment)
            shift += 1
        return moments


@dataclass(frozen=True)
class Plan:
    """A schedule loaded once: its layers (highest first) and its overrides (latest created first)."""

    layers: tuple[Layer, ...]
    overrides: tuple[ScheduleOverride, ...]

    @classmethod
    def load(cls, schedule: Schedule, since: datetime | None = None) -> Plan:
        zone = time_zone(schedule.time_zone)
        layers = []
        members = Prefetch("members", LayerMember.objects.select_related("user").order_by("position"))
        for layer in schedule.layers.prefetch_related(members).order_by("-position"):
            local = layer.starts_at.astimezone(zone).replace(tzinfo=None)
            layers.append(Layer(number=layer.position + 1, period=PERIOD[layer.rotation], anchor=local, zone=zone,
                                starts_at=layer.starts_at, ends_at=layer.ends_at,
                                members=tuple(member.user for member in layer.members.all())))
        overrides = schedule.overrides.select_related("user").order_by("-created_at", "-id")
        if since is not None:
            overrides = overrides.filter(ends_at__gt=since)
        return cls(layers=tuple(layers), overrides=tuple(overrides))

    def who(self, at: datetime) -> tuple[object | None, str | None]:
        """(user, source) on call at `at`, or (None, None) when nobody is."""
        for override in self.overrides:
            if override.starts_at <= at < override.ends_at:
                return override.user, OVERRIDE
        for layer in self.layers:
            if layer.covers(at):
                return layer.member_at(at), layer.source
        return None, None

    def changes(self, after: datetime, until: datetime) -> list[datetime]:
        moments = {t for layer in self.layers for t in layer.changes(after, until)}
        moments |= {t for o in self.overrides for t in (o.starts_at, o.ends_at) if after < t <= until}
        return sorted(moments)

    def next_change(self, after: datetime, horizon: timedelta) -> tuple[datetime, object | None] | None:
        current = user_key(self.who(after)[0])
        for moment in self.changes(after, after + horizon):
            user, _ = self.who(moment)
            if user_key(user) != current:
                return moment, user
        return None

    def shifts(self, start: datetime, end: datetime) -> list[dict]:
        moments = [start, *(t for t in self.changes(start, end) if t < end), end]
        pieces: list[dict] = []
        for begin, finish in zip(moments, moments[1:], strict=False):
            user, source = self.who(begin)
            if user is None:
                continue
            last = pieces[-1] if pieces else None
            if last and last["ends_at"] == begin and last["source"] == source and user_key(last["user"]) == user.pk:
                last["ends_at"] = finish
            else:
                pieces.append({"user": user, "starts_at": begin, "ends_at": finish, "source": source})
        return pieces


def user_key(user) -> int | None:
    return user.pk if user is not None else None


def on_call(schedule: Schedule, at: datetime):
    """The user on call at `at`, or None when no override or layer covers it."""
    return Plan.load(schedule, since=at).who(at)[0]


def next_change(schedule: Schedule, after: datetime, horizon: timedelta = NEXT_CHANGE_HORIZON):
    """(when, who) of the first moment after `after` where the person on call differs from the one
    at `after` (who may be None: nobody), or None if it stays the same within `horizon`."""
    return Plan.load(schedule, since=after).next_change(after, horizon)


def shifts(schedule: Schedule, start: datetime, end: datetime) -> list[dict]:
    """The final timeline over [start, end): [{"user", "starts_at", "ends_at", "source"}], where
    source is "override" or "layer N"; adjacent pieces of one user and source are merged, and
    stretches with nobody on call are left out."""
    return Plan.load(schedule, since=start).shifts(start, end)


def on_call_summary(schedule: Schedule, at: datetime) -> dict:
    """Who is on call now and until when, and who is next: the API's and the pages' answer."""
    plan = Plan.load(schedule, since=at)
    change = plan.next_change(at, NEXT_CHANGE_HORIZON)
    return {"now": {"user": plan.who(at)[0], "until": change[0] if change else None},
            "next": {"user": change[1], "from": change[0]} if change else None}


# ------------------------------------------------------------------------------------ services


def schedule_snapshot(schedule: Schedule) -> dict:
    data = snapshot(schedule)
    data["layers"] = [
        {"name": layer.name, "rotation": layer.rotation, "starts_at": layer.starts_at.isoformat(),
         "ends_at": layer.ends_at.isoformat() if layer.ends_at else None,
         "users": [member.user.username for member in layer.members.select_related("user").order_by("position")]}
        for layer in schedule.layers.order_by("position")]
    return data


def users_by_name(usernames) -> dict:
    return {user.username: user for user in get_user_model().objects.filter(username__in=list(usernames))}


def validate_layers(layers: list[dict]) -> dict:
    """The users the layers name, by username; ValidationError on `layers` naming layer and reason."""
    if not isinstance(layers, list):
        raise ValidationError({"layers": ["Must be a list of layers."]})
    known = users_by_name({name for layer in layers for name in layer.get("users") or []})
    problems = []
    for number, layer in enumerate(layers, start=1):
        unknown_fields = sorted(set(layer) - set(LAYER_FIELDS))
        if unknown_fields:
            problems.append(f"Layer {number}: unknown field {', '.join(map(repr, unknown_fields))}.")
        if layer.get("rotation") not in Rotation.values:
            problems.append(f"Layer {number}: rotation {layer.get('rotation')!r} is not one of "
                            f"{', '.join(Rotation.values)}.")
        if not isinstance(layer.get("starts_at"), datetime):
            problems.append(f"Layer {number}: starts_at is required (the first hand-off).")
        elif layer.get("ends_at") is not None and layer["ends_at"] <= layer["starts_at"]:
            problems.append(f"Layer {number}: ends_at must come after starts_at.")
        users = layer.get("users") or []
        if not users:
            problems.append(f"Layer {number}: give at least one user.")
        missing = [name for name in users if name not in known]
        if missing:
            problems.append(f"Layer {number}: no user named {', '.join(map(repr, missing))}.")
    if problems:
        raise ValidationError({"layers": problems})
    return known


def schedule_save(*, instance: Schedule | None, fields: dict, layers: list[dict], actor) -> Schedule:
    """Create a schedule (instance None) or replace one, with its layers and members, in one
    transaction. `fields`: name, time_zone, description; each layer: name, rotation, starts_at,
    ends_at, users (usernames in rotation order). Later layers override earlier ones."""
    unknown = set(fields) - {"name", "time_zone", "description"}
    if unknown:
        raise ValidationError({field: ["Not a field of a schedule."] for field in sorted(unknown)})
    # A fresh copy to change: a refused save leaves the caller's instance as it was.
    schedule = Schedule.objects.get(pk=instance.pk) if instance else Schedule()
    before = schedule_snapshot(schedule) if instance else None
    for field, value in fields.items():
        setattr(schedule, field, value)
    time_zone(schedule.time_zone)
    schedule.full_clean(validate_unique=False)
    known = validate_layers(layers)
    try:
        with transaction.atomic():
            if instance is not None:
                Schedule.objects.select_for_update().get(pk=instance.pk)
            schedule.save()
            schedule.layers.all().delete()
            for position, layer in enumerate(layers):
                row = ScheduleLayer.objects.create(schedule=schedule, position=position, name=layer.get("name") or "",
                                                   rotation=layer["rotation"], starts_at=layer["starts_at"],
                                                   ends_at=layer.get("ends_at"))
                LayerMember.objects.bulk_create(LayerMember(layer=row, user=known[name], position=index)
                                                for index, name in enumerate(layer["users"]))
            action = "schedule.update" if instance else "schedule.create"
            audit_record(actor=actor, action=action, obj=schedule, before=before, after=schedule_snapshot(schedule))
    except IntegrityError:
        raise Conflict(f"A schedule named {schedule.name!r} already exists.") from None
    return schedule


def schedule_delete(*, schedule: Schedule, actor) -> None:
    """Delete it with its layers and overrides, unless an escalation policy still pages it."""
    with transaction.atomic():
        locked = Schedule.objects.select_for_update().get(pk=schedule.pk)
        policies = sorted(set(EscalationStep.objects.filter(schedule=locked).values_list("policy__name", flat=True)))
        if policies:
            raise Conflict(f"Schedule {locked.name!r} is used by escalation "
                           f"polic{'ies' if len(policies) > 1 else 'y'} {', '.join(map(repr, policies))}: "
                           f"remove it from their steps first.")
        before = schedule_snapshot(locked)
        audit_record(actor=actor, action="schedule.delete", obj=locked, before=before)
        locked.delete()


def override_create(*, schedule: Schedule, username: str, starts_at: datetime, ends_at: datetime, reason: str = "",
                    actor) -> ScheduleOverride:
    """`username` takes the schedule over [starts_at, ends_at), above every layer."""
    user = users_by_name([username]).get(username)
    if user is None:
        raise ValidationError({"user": [f"No user named {username!r}."]})
    if ends_at <= starts_at:
        raise ValidationError({"ends_at": ["ends_at must come after starts_at."]})
    override = ScheduleOverride(schedule=schedule, user=user, starts_at=starts_at, ends_at=ends_at, reason=reason,
                                created_by=actor_or_none(actor))
    override.full_clean()
    with transaction.atomic():
        override.save()
        audit_record(actor=actor, action="schedule.override.create", obj=override, after=snapshot(override))
    return override


def override_delete(*, override: ScheduleOverride, actor) -> None:
    with transaction.atomic():
        audit_record(actor=actor, action="schedule.override.delete", obj=override, before=snapshot(override))
        override.delete()
