"""Who is on call: daily and weekly hand-offs at the local time of the first one (across a DST
change too), layers (higher wins, not before it starts nor after it ends), overrides (the latest
created wins), when it next changes, and the merged timeline; the services write atomically and
leave an audit trail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.core.exceptions import ValidationError

from alerts.models import EscalationPolicy, EscalationStep, Schedule, ScheduleOverride
from alerts.schedules.services import (
    next_change,
    on_call,
    override_create,
    override_delete,
    schedule_delete,
    schedule_save,
    shifts,
)
from inferops.api import Conflict
from inferops.models import AuditEvent

pytestmark = pytest.mark.django_db

BERLIN = ZoneInfo("Europe/Berlin")
T0 = datetime(2025, 3, 3, 9, 0, tzinfo=UTC)  # a Monday


@pytest.fixture
def people(make_user):
    return {name: make_user(None, username=name) for name in ("alice", "bob", "carol", "dave")}


def layer(users, starts_at=T0, rotation="daily", ends_at=None, name=""):
    return {"name": name, "rotation": rotation, "starts_at": starts_at, "ends_at": ends_at, "users": users}


def make(layers, time_zone="UTC", name="primary", actor=None) -> Schedule:
    return schedule_save(instance=None, fields={"name": name, "time_zone": time_zone, "description": ""},
                         layers=layers, actor=actor)


def who(schedule, at) -> str | None:
    user = on_call(schedule, at)
    return user.username if user else None


def test_daily_rotation_hands_off_every_day_at_the_first_hand_offs_time(people):
    schedule = make([layer(["alice", "bob", "carol"])])
    assert who(schedule, T0 - timedelta(seconds=1)) is None  # not started yet
    assert who(schedule, T0) == "alice"
    assert who(schedule, T0 + timedelta(hours=23, minutes=59)) == "alice"
    assert who(schedule, T0 + timedelta(days=1)) == "bob"
    assert who(schedule, T0 + timedelta(days=2, hours=5)) == "carol"
    assert who(schedule, T0 + timedelta(days=3)) == "alice"  # round again
    assert who(schedule, T0 + timedelta(days=301)) == ["alice", "bob", "carol"][301 % 3]


def test_weekly_rotation_with_a_user_taking_two_turns(people):
    schedule = make([layer(["alice", "bob", "alice", "carol"], rotation="weekly")])
    turns = [who(schedule, T0 + timedelta(weeks=week, days=3)) for week in range(6)]
    assert turns == ["alice", "bob", "alice", "carol", "alice", "bob"]
    assert who(schedule, T0 + timedelta(weeks=1) - timedelta(seconds=1)) == "alice"
    timeline = shifts(schedule, T0, T0 + timedelta(weeks=4))
    assert [(s["user"].username, s["starts_at"], s["ends_at"]) for s in timeline] == [
        ("alice", T0, T0 + timedelta(weeks=1)), ("bob", T0 + timedelta(weeks=1), T0 + timedelta(weeks=2)),
        ("alice", T0 + timedelta(weeks=2), T0 + timedelta(weeks=3)),
        ("carol", T0 + timedelta(weeks=3), T0 + timedelta(weeks=4))]
    assert {s["source"] for s in timeline} == {"layer 1"}


def test_hand_off_keeps_local_time_across_dst_in_berlin(people):
    # 09:00 Berlin on Friday 2025-03-28 (CET, UTC+1); the clocks go forward on Sunday 30 March.
    first = datetime(2025, 3, 28, 9, 0, tzinfo=BERLIN)
    schedule = make([layer(["alice", "bob"], starts_at=first)], time_zone="Europe/Berlin")
    sunday, monday = datetime(2025, 3, 30, 9, 0, tzinfo=BERLIN), datetime(2025, 3, 31, 9, 0, tzinfo=BERLIN)
    assert sunday.astimezone(UTC).hour == 7 and datetime(2025, 3, 29, 9, tzinfo=BERLIN).astimezone(UTC).hour == 8
    assert who(schedule, sunday - timedelta(minutes=1)) == "bob"  # Saturday's shift, 23 hours long
    assert who(schedule, sunday) == "alice"
    assert who(schedule, monday - timedelta(minutes=1)) == "alice"
    assert who(schedule, monday) == "bob"
    assert next_change(schedule, datetime(2025, 3, 29, 12, 0, tzinfo=BERLIN))[0] == sunday
    timeline = shifts(schedule, first, datetime(2025, 4, 1, 9, 0, tzinfo=BERLIN))
    assert [s["starts_at"].astimezone(BERLIN).hour for s in timeline] == [9, 9, 9, 9]
    assert [s["ends_at"] - s["starts_at"] for s in timeline] == [
        timedelta(hours=24), timedelta(hours=23), timedelta(hours=24), timedelta(hours=24)]
    # And back in October: the Saturday-to-Sunday shift lasts 25 hours, hand-offs still at 09:00.
    autumn = datetime(2025, 10, 25, 9, 0, tzinfo=BERLIN)
    change = next_change(schedule, autumn + timedelta(minutes=1))
    assert change[0] == datetime(2025, 10, 26, 9, 0, tzinfo=BERLIN)
    assert change[0] - autumn == timedelta(hours=25)


def test_higher_layers_override_lower_ones_within_their_dates(people):
    weekday = T0 + timedelta(days=10)
    schedule = make([
        layer(["alice", "bob"], rotation="weekly"),
        layer(["carol"], starts_at=weekday, ends_at=weekday + timedelta(days=2), name="training week"),
        layer(["dave"], starts_at=T0 + timedelta(days=30), name="not yet"),
    ])
    assert who(schedule, weekday - timedelta(seconds=1)) == "bob"
    assert who(schedule, weekday) == "carol"
    assert who(schedule, weekday + timedelta(days=2)) == "bob"  # the layer ended: the one below shows
    assert who(schedule, T0 + timedelta(days=30)) == "dave"
    assert next_change(schedule, T0 + timedelta(days=8)) == (weekday, people["carol"])
    timeline = shifts(schedule, T0 + timedelta(days=7), T0 + timedelta(days=14))
    assert [(s["user"].username, s["source"], s["starts_at"], s["ends_at"]) for s in timeline] == [
        ("bob", "layer 1", T0 + timedelta(days=7), weekday),
        ("carol", "layer 2", weekday, weekday + timedelta(days=2)),
        ("bob", "layer 1", weekday + timedelta(days=2), T0 + timedelta(days=14))]


def test_overrides_win_and_the_latest_created_wins_among_them(people):
    schedule = make([layer(["alice"])])
    at = T0 + timedelta(days=3, hours=2)
    first = override_create(schedule=schedule, username="bob", starts_at=at, ends_at=at + timedelta(hours=4),
                            reason="swap", actor=None)
    assert who(schedule, at - timedelta(seconds=1)) == "alice"
    assert who(schedule, at) == "bob"
    override_create(schedule=schedule, username="carol", starts_at=at + timedelta(hours=1),
                    ends_at=at + timedelta(hours=2), reason="", actor=None)
    assert who(schedule, at + timedelta(hours=1)) == "carol"
    assert who(schedule, at + timedelta(hours=2)) == "bob"
    assert who(schedule, at + timedelta(hours=4)) == "alice"
    assert next_change(schedule, T0) == (at, people["bob"])
    assert next_change(schedule, at) == (at + timedelta(hours=1), people["carol"])
    timeline = shifts(schedule, at - timedelta(hours=1), at + timedelta(hours=5))
    assert [(s["user"].username, s["source"], s["ends_at"] - s["starts_at"]) for s in timeline] == [
        ("alice", "layer 1", timedelta(hours=1)), ("bob", "override", timedelta(hours=1)),
        ("carol", "override", timedelta(hours=1)), ("bob", "override", timedelta(hours=2)),
        ("alice", "layer 1", timedelta(hours=1))]
    override_delete(override=first, actor=None)
    assert who(schedule, at) == "alice"


def test_next_change_skips_hand_offs_to_the_same_person_and_gives_up_at_the_horizon(people):
    schedule = make([layer(["alice"])])
    assert next_change(schedule, T0) is None  # alice every day: nobody else within 60 days
    schedule = make([layer(["alice"], ends_at=T0 + timedelta(days=5))], name="ends")
    assert next_change(schedule, T0) == (T0 + timedelta(days=5), None)
    assert next_change(schedule, T0 - timedelta(days=1)) == (T0, people["alice"])
    assert next_change(schedule, T0 - timedelta(days=100), horizon=timedelta(days=10)) is None
    assert shifts(schedule, T0 - timedelta(days=1), T0 + timedelta(days=10)) == [
        {"user": people["alice"], "starts_at": T0, "ends_at": T0 + timedelta(days=5), "source": "layer 1"}]


def test_save_replaces_layers_atomically_and_audits(people, make_user):
    actor = make_user("operator", username="ops")
    schedule = make([layer(["alice", "bob"])], actor=actor)
    assert AuditEvent.objects.get(action="schedule.create").after["layers"][0]["users"] == ["alice", "bob"]
    schedule_save(instance=schedule, fields={"time_zone": "Europe/Berlin"},
                  layers=[layer(["carol"]), layer(["dave"], rotation="weekly")], actor=actor)
    schedule.refresh_from_db()
    assert schedule.time_zone == "Europe/Berlin"
    assert [(lay.position, [m.user.username for m in lay.members.all()]) for lay in schedule.layers.all()] == [
        (0, ["carol"]), (1, ["dave"])]
    event = AuditEvent.objects.get(action="schedule.update")
    assert event.before["layers"][0]["users"] == ["alice", "bob"] and event.actor_name == "ops"

    bad = [
        ({"time_zone": "Mars/Olympus"}, [layer(["alice"])], "time_zone"),
        ({}, [layer(["alice", "zed"])], "layers"),
        ({}, [layer([])], "layers"),
        ({}, [layer(["alice"], rotation="hourly")], "layers"),
        ({}, [layer(["alice"], ends_at=T0)], "layers"),
        ({"name": "Not A Slug"}, [layer(["alice"])], "name"),
    ]
    for fields, layers, field in bad:
        with pytest.raises(ValidationError) as caught:
            schedule_save(instance=schedule, fields=fields, layers=layers, actor=actor)
        assert field in caught.value.message_dict
    schedule.refresh_from_db()
    assert schedule.time_zone == "Europe/Berlin" and schedule.layers.count() == 2
    with pytest.raises(Conflict):
        make([layer(["alice"])], name="primary")
    assert AuditEvent.objects.filter(object_type="alerts.schedule").count() == 2


def test_a_schedule_an_escalation_policy_uses_cannot_be_deleted(people):
    schedule = make([layer(["alice"])])
    override_create(schedule=schedule, username="bob", starts_at=T0, ends_at=T0 + timedelta(hours=1), actor=None)
    policy = EscalationPolicy.objects.create(name="db-team")
    step = EscalationStep.objects.create(policy=policy, position=0, after_minutes=5, schedule=schedule)
    with pytest.raises(Conflict, match="db-team"):
        schedule_delete(schedule=schedule, actor=None)
    step.delete()
    schedule_delete(schedule=schedule, actor=None)
    assert not Schedule.objects.exists() and not ScheduleOverride.objects.exists()
    assert AuditEvent.objects.filter(action="schedule.delete").exists()


def test_override_validation(people):
    schedule = make([layer(["alice"])])
    with pytest.raises(ValidationError, match="zed"):
        override_create(schedule=schedule, username="zed", starts_at=T0, ends_at=T0 + timedelta(hours=1), actor=None)
    with pytest.raises(ValidationError) as caught:
        override_create(schedule=schedule, username="bob", starts_at=T0, ends_at=T0, actor=None)
    assert "ends_at" in caught.value.message_dict
    assert not ScheduleOverride.objects.exists()
