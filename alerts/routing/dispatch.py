"""Routing, grouping, escalation and repeats: which targets hear of a firing alert, and when.

Alertmanager's model. An alert walks the routing tree from the default route (first matching
child, and its following siblings while a route says `continue`); each route that takes it puts
it into the group of its `group_by` label values. A new group is notified `group_wait` after its
first alert, alerts joining it later at most every `group_interval`, all of a group's news to one
target in one message. While alerts of a group stay firing and unacknowledged, the group moves
to its next round: the next step of its escalation policy (`after_minutes` after the group was
first notified), or after the last step (or for a plain receiver) a repeat every
`repeat_interval`. A round notifies each target of each alert at most once (a unique constraint
on notifications), so a redelivered beat or two workers never send twice.

Acknowledgements and resolutions are not delayed: they go at once to every target the alert's
firing reached (alerts/services.py), so a page stops as soon as someone has it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from alerts.choices import OPEN_STATUSES, AlertStatus, EventKind, MatchOp, NotificationStatus
from alerts.models import Alert, AlertGroup, EscalationStep, Notification, Receiver, Route
from alerts.schedules.services import on_call
from alerts.silences.muting import muting_reason
from alerts.timeline import record_event
from inferops.celery import enqueue

log = logging.getLogger(__name__)

GROUP_BY_ALL = "..."


@dataclass(frozen=True)
class Timing:
    group_by: list[str]
    group_wait_s: int
    group_interval_s: int
    repeat_interval_s: int


def default_route() -> Route:
    """The root of the tree, made on first use from the INFEROPS_ALERT_* settings; with neither a
    receiver nor a policy it notifies every active receiver."""
    route = Route.objects.filter(is_default=True).first()
    if route is not None:
        return route
    try:
        with transaction.atomic():
            return Route.objects.create(
                is_default=True, group_by=list(settings.INFEROPS_ALERT_GROUP_BY),
                group_wait_s=settings.INFEROPS_ALERT_GROUP_WAIT_S,
                group_interval_s=settings.INFEROPS_ALERT_GROUP_INTERVAL_S,
                repeat_interval_s=settings.INFEROPS_ALERT_REPEAT_INTERVAL_S)
    except IntegrityError:  # another process made it first
        return Route.objects.get(is_default=True)


def matcher_holds(matcher: dict, labels: dict[str, str]) -> bool:
    """A route matcher {"name", "value", "op"}; regexes match the whole value, a missing label is ""."""
    value, op = labels.get(matcher["name"], ""), matcher.get("op", MatchOp.EQUAL)
    if op in (MatchOp.REGEX, MatchOp.NOT_REGEX):
        hit = re.fullmatch(matcher["value"], value) is not None
        return hit if op == MatchOp.REGEX else not hit
    return (value == matcher["value"]) == (op == MatchOp.EQUAL)


class Tree:
    """The routing tree as loaded once (a handful of rows): matching and inherited settings."""

    def __init__(self) -> None:
        self.root = default_route()
        self.routes = {route.pk: route for route in Route.objects.select_related("receiver", "escalation_policy")}
        self.routes[self.root.pk] = self.routes.get(self.root.pk, self.root)
        self.children: dict[int, list[Route]] = defaultdict(list)
        for route in sorted(self.routes.values(), key=lambda r: (r.position, r.pk)):
            if route.parent_id:
                self.children[route.parent_id].append(route)

    def match(self, labels: dict[str, str]) -> list[Route]:
        """The deepest routes that take the alert, in tree order (the default route if none)."""
        def walk(route: Route) -> list[Route]:
            taken: list[Route] = []
            for child in self.children[route.pk]:
                if all(matcher_holds(m, labels) for m in child.matchers):
                    taken += walk(child)
                    if not child.continue_matching:
                        break
            return taken or [route]

        return walk(self.routes[self.root.pk])

    def lineage(self, route: Route) -> list[Route]:
        """The route and its ancestors up to the default route."""
        chain = [route]
        while chain[-1].parent_id and chain[-1].parent_id in self.routes:
            chain.append(self.routes[chain[-1].parent_id])
        return chain

    def timing(self, route: Route) -> Timing:
        chain = self.lineage(route)

        def inherited(name: str):
            return next((getattr(r, name) for r in chain if getattr(r, name) is not None),
                        getattr(self.routes[self.root.pk], name))

        return Timing(group_by=inherited("group_by") or [], group_wait_s=inherited("group_wait_s") or 0,
                      group_interval_s=inherited("group_interval_s") or 0,
                      repeat_interval_s=inherited("repeat_interval_s") or 0)

    def notifier(self, route: Route) -> Route:
        """The nearest route (itself or an ancestor) that names a receiver or a policy; the default
        route otherwise, which then means every active receiver."""
        return next((r for r in self.lineage(route) if r.receiver_id or r.escalation_policy_id),
                    self.routes[self.root.pk])


def group_labels(labels: dict[str, str], group_by: list[str]) -> dict[str, str]:
    if GROUP_BY_ALL in group_by:
        return dict(labels)
    return {name: labels[name] for name in group_by if name in labels}


def group_key(route: Route, labels: dict[str, str]) -> str:
    canonical = json.dumps([route.pk, labels], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------- alerts joining groups


def alert_route(alert: Alert, now: datetime) -> list[AlertGroup]:
    """Put a newly firing alert into the group of each route that takes it; a group that is due
    (group_wait 0, or group_interval over) is notified in this transaction, the others by the
    beat (`groups_advance`)."""
    tree = Tree()
    groups = []
    for route in tree.match(alert.labels):
        timing = tree.timing(route)
        labels = group_labels(alert.labels, timing.group_by)
        group, _ = AlertGroup.objects.get_or_create(route=route, key=group_key(route, labels),
                                                    defaults={"labels": labels})
        group = AlertGroup.objects.select_for_update().get(pk=group.pk)
        group.alerts.add(alert)
        _schedule_flush(tree, group, now)
        groups.append(group)
    return groups


def alert_unmuted(alert: Alert, now: datetime) -> None:
    """A muted alert may notify now: its groups take it at their next flush."""
    groups = list(alert.groups.values_list("pk", flat=True))
    if not groups:  # muted before routing existed, or its route was deleted since
        alert_route(alert, now)
        return
    tree = Tree()
    for pk in groups:
        _schedule_flush(tree, AlertGroup.objects.select_for_update().select_related("route").get(pk=pk), now)


def alert_closed(alert: Alert) -> None:
    """A resolved alert: a group left without open alerts ends its episode, so the next alert
    starts afresh (group_wait, escalation from step 1)."""
    for pk in alert.groups.values_list("pk", flat=True):
        group = AlertGroup.objects.select_for_update().get(pk=pk)
        if not group.alerts.filter(status__in=OPEN_STATUSES).exists():
            _end_episode(group)
            group.flush_at = None
            group.save(update_fields=["first_notified_at", "round", "round_at", "flush_at"])


def _schedule_flush(tree: Tree, group: AlertGroup, now: datetime) -> None:
    if group.flush_at is not None:
        return
    timing = tree.timing(group.route)
    if group.first_notified_at is None:
        group.flush_at = now + timedelta(seconds=timing.group_wait_s)
    else:
        group.flush_at = max(now, group.last_flushed_at + timedelta(seconds=timing.group_interval_s))
    if group.flush_at <= now:
        _flush(tree, group, now)
    else:
        group.save(update_fields=["flush_at"])


# ---------------------------------------------------------------------------- notifying a group


@dataclass(frozen=True)
class Target:
    receiver: Receiver | None = None
    user: object | None = None

    @property
    def filter(self) -> dict:
        return {"receiver": self.receiver, "user": self.user}


def targets(tree: Tree, group: AlertGroup, round_: int, now: datetime) -> list[Target]:
    """Who hears of the group in this round: its route's receiver, the escalation step of this
    round (the last step again once all have run), or every active receiver for a bare default
    route."""
    notifier = tree.notifier(group.route)
    if notifier.receiver_id:
        return [Target(receiver=notifier.receiver)] if notifier.receiver.active else []
    if not notifier.escalation_policy_id:
        return [Target(receiver=r) for r in Receiver.objects.filter(active=True)]
    steps = list(EscalationStep.objects.filter(policy_id=notifier.escalation_policy_id)
                 .select_related("schedule").prefetch_related("receivers", "users"))
    if not steps:
        return []
    step = steps[min(round_, len(steps) - 1)]
    people = list(step.users.all())
    if step.schedule is not None and (person := on_call(step.schedule, now)) is not None:
        people.append(person)
    found = [Target(receiver=r) for r in step.receivers.all() if r.active]
    found += [Target(user=u) for u in dict.fromkeys(people)]
    return found


def _next_round_at(tree: Tree, group: AlertGroup, now: datetime) -> datetime | None:
    notifier = tree.notifier(group.route)
    if notifier.escalation_policy_id:
        later = list(EscalationStep.objects.filter(policy_id=notifier.escalation_policy_id, position__gt=group.round)
                     .order_by("position").values_list("after_minutes", flat=True)[:1])
        if later:
            return max(now, group.first_notified_at + timedelta(minutes=later[0]))
    repeat = tree.timing(group.route).repeat_interval_s
    return now + timedelta(seconds=repeat) if repeat else None


def _notify(tree: Tree, group: AlertGroup, now: datetime) -> int:
    """Notify this round's targets of the group's firing, unacknowledged, unmuted alerts they
    have not heard of in this round. Returns how many notifications were made."""
    alerts = [a for a in group.alerts.filter(status=AlertStatus.FIRING) if not muting_reason(a, now)]
    if not alerts:
        return 0
    made = 0
    for target in targets(tree, group, group.round, now):
        if target.user is not None and not target.user.email:
            for alert in alerts:
                record_event(alert, EventKind.NOTIFY_FAILED, at=now, data={"user": target.user.username},
                             text=f"cannot page {target.user.username}: no email address")
            continue
        Notification.objects.bulk_create(
            [Notification(alert=a, group=group, round=group.round, alert_status=AlertStatus.FIRING, **target.filter)
             for a in alerts], ignore_conflicts=True)
        lead = (Notification.objects.filter(group=group, round=group.round, alert_status=AlertStatus.FIRING,
                                            status=NotificationStatus.PENDING, **target.filter)
                .order_by("pk").values_list("pk", flat=True).first())
        if lead is not None:
            transaction.on_commit(lambda pk=lead: enqueue("alerts.deliver_notification", pk))
            made += 1
    if made and group.first_notified_at is None:
        group.first_notified_at = now
    return made


def _flush(tree: Tree, group: AlertGroup, now: datetime) -> None:
    group.flush_at = None
    group.last_flushed_at = now
    if not group.alerts.filter(status__in=OPEN_STATUSES).exists():
        _end_episode(group)
    else:
        first = group.first_notified_at is None
        _notify(tree, group, now)
        if first and group.first_notified_at is not None:
            group.round_at = _next_round_at(tree, group, now)
    group.save(update_fields=["flush_at", "last_flushed_at", "first_notified_at", "round", "round_at"])


def _end_episode(group: AlertGroup) -> None:
    """Every alert of the group resolved: the next one starts afresh (group_wait, step 1)."""
    group.first_notified_at, group.round, group.round_at = None, 0, None


def groups_advance(now: datetime | None = None) -> dict[str, int]:
    """Beat: notify the groups whose flush is due, and move on the rounds (escalation steps and
    repeats) of groups still firing unacknowledged. Each group is locked and re-checked, so
    overlapping beats do each thing once."""
    now = now or timezone.now()
    tree = Tree()
    flushed = rounds = 0
    for pk in AlertGroup.objects.filter(flush_at__lte=now).values_list("pk", flat=True):
        with transaction.atomic():
            group = AlertGroup.objects.select_for_update().select_related("route").get(pk=pk)
            if group.flush_at is not None and group.flush_at <= now:
                _flush(tree, group, now)
                flushed += 1
    for pk in AlertGroup.objects.filter(round_at__lte=now).values_list("pk", flat=True):
        with transaction.atomic():
            group = AlertGroup.objects.select_for_update().select_related("route").get(pk=pk)
            if group.round_at is None or group.round_at > now:
                continue
            if not group.alerts.filter(status=AlertStatus.FIRING).exists():
                # Acknowledged or resolved: the escalation stops here.
                if not group.alerts.filter(status__in=OPEN_STATUSES).exists():
                    _end_episode(group)
                group.round_at = None
            else:
                group.round += 1
                _notify(tree, group, now)
                group.round_at = _next_round_at(tree, group, now)
                rounds += 1
            group.save(update_fields=["first_notified_at", "round", "round_at"])
    return {"flushed": flushed, "rounds": rounds}


# ---------------------------------------------------------------------------- a target appears


def groups_notify_waiting(now: datetime | None = None) -> int:
    """Notify the groups whose firing alerts reached no one because their route had no target (no
    receiver yet, or a route without one): a receiver has appeared, and they would otherwise wait
    for a new alert to join. A group still in its group_wait is left to its flush, a muted alert
    to its mute's end; the group lock and the unique notifications keep a second run from sending
    twice. Returns how many groups notified someone."""
    now = now or timezone.now()
    tree = Tree()
    waiting = (AlertGroup.objects.filter(first_notified_at__isnull=True, flush_at__isnull=True,
                                         alerts__status=AlertStatus.FIRING)
               .values_list("pk", flat=True).distinct())
    notified = 0
    for pk in waiting:
        with transaction.atomic():
            group = AlertGroup.objects.select_for_update().select_related("route").get(pk=pk)
            if group.first_notified_at is not None or group.flush_at is not None:
                continue  # notified or scheduled meanwhile
            _flush(tree, group, now)
            notified += group.first_notified_at is not None
    return notified


def waiting_groups_notify_on_commit() -> None:
    """A receiver appeared (or a route gained a target): once committed, tell the groups waiting for one."""
    transaction.on_commit(lambda: enqueue("alerts.notify_waiting_groups"))
