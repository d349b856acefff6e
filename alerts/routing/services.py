"""Writing the routing tree and escalation policies: validated, atomic and audited.

Shared by the REST API and the console. Validation errors are Django ValidationErrors keyed by
field, which the API turns into DRF-style 400s and the console shows beside the form.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import ProtectedError

from alerts.choices import MatchOp
from alerts.matchers import LABEL_NAME, matcher_problem
from alerts.models import EscalationPolicy, EscalationStep, Route
from alerts.routing.dispatch import GROUP_BY_ALL, default_route, waiting_groups_notify_on_commit
from inferops.api import Conflict
from inferops.audit import audit_record, snapshot

MAX_MATCHERS = 50
MAX_STEPS = 20
GROUPING_FIELDS = ("group_by", "group_wait_s", "group_interval_s", "repeat_interval_s")


def clean_matchers(matchers) -> list[dict]:
    """[{"name", "value", "op"}] with op = != =~ !~ (default =), each passing alerts.matchers'
    checks; an error names the matcher by its index."""
    if not isinstance(matchers, list) or len(matchers) > MAX_MATCHERS:
        raise ValidationError({"matchers": [f"A list of at most {MAX_MATCHERS} matchers."]})
    cleaned = []
    for index, matcher in enumerate(matchers):
        where = f"matchers[{index}]"
        if not isinstance(matcher, dict) or set(matcher) - {"name", "value", "op"}:
            raise ValidationError({"matchers": [f"{where}: an object with name, value and op only."]})
        name, value, op = matcher.get("name"), matcher.get("value"), matcher.get("op", MatchOp.EQUAL)
        if op not in MatchOp.values:
            raise ValidationError({"matchers": [f"{where}: op {op!r}: use one of {' '.join(MatchOp.values)}."]})
        if problem := matcher_problem(name, op, value):
            raise ValidationError({"matchers": [f"{where} {problem[0]}: {problem[1]}"]})
        cleaned.append({"name": name, "value": value, "op": op})
    return cleaned


def clean_group_by(group_by) -> list[str] | None:
    if group_by is None:
        return None
    if (not isinstance(group_by, list) or len(group_by) > 30
            or not all(isinstance(n, str) and (n == GROUP_BY_ALL or LABEL_NAME.fullmatch(n)) for n in group_by)):
        raise ValidationError({"group_by": ['A list of label names, or ["..."] to group by every label.']})
    if GROUP_BY_ALL in group_by and len(group_by) > 1:
        raise ValidationError({"group_by": ['"..." groups by every label: it stands alone.']})
    return list(dict.fromkeys(group_by))


def _descendants(route: Route) -> set[int]:
    found, frontier = set(), [route.pk]
    while frontier:
        frontier = list(Route.objects.filter(parent_id__in=frontier).values_list("pk", flat=True))
        found.update(frontier)
    return found


def route_save(*, instance: Route | None, fields: dict, actor) -> Route:
    """Create a route (instance None; under the default route unless `parent` says) or change
    one. The default route matches everything: it takes no matchers, parent or position."""
    route = instance or Route()
    before = snapshot(instance) if instance else None
    target_before = (route.receiver_id, route.escalation_policy_id)
    if "matchers" in fields:
        fields["matchers"] = clean_matchers(fields["matchers"])
    if "group_by" in fields:
        fields["group_by"] = clean_group_by(fields["group_by"])
    for name, value in fields.items():
        setattr(route, name, value)
    if route.is_default:
        if route.matchers or route.parent_id or route.continue_matching:
            raise ValidationError({"matchers": ["The default route takes every alert: no matchers, parent or "
                                                "continue."]})
        if any(getattr(route, name) is None for name in GROUPING_FIELDS):
            raise ValidationError({"group_by": ["The default route's grouping settings are what others inherit: "
                                                "give each a value."]})
    else:
        route.parent = route.parent or default_route()
        if route.pk and (route.parent_id == route.pk or route.parent_id in _descendants(route)):
            raise ValidationError({"parent": ["A route cannot sit under itself or one of its children."]})
    if route.receiver_id and route.escalation_policy_id:
        raise ValidationError({"receiver": ["A route notifies a receiver or an escalation policy, not both."]})
    target = (route.receiver_id, route.escalation_policy_id)
    with transaction.atomic():
        route.save()
        audit_record(actor=actor, action="route.update" if before else "route.create", obj=route, before=before,
                     after=snapshot(route))
        if any(target) and target != target_before:  # its groups may have been waiting for a target
            waiting_groups_notify_on_commit()
    return route


def route_delete(*, route: Route, actor) -> None:
    """Its children go with it; its groups too (their open alerts have been notified already)."""
    if route.is_default:
        raise Conflict("The default route cannot be deleted: every alert that no other route takes goes there.")
    with transaction.atomic():
        audit_record(actor=actor, action="route.delete", obj=route, before=snapshot(route))
        route.delete()


def clean_steps(steps) -> None:
    if not steps:
        raise ValidationError({"steps": ["An escalation policy needs at least one step."]})
    if len(steps) > MAX_STEPS:
        raise ValidationError({"steps": [f"At most {MAX_STEPS} steps."]})
    previous = -1
    for index, step in enumerate(steps):
        if not (step["receivers"] or step["users"] or step["schedule"]):
            raise ValidationError({"steps": [f"steps[{index}]: notify someone: receivers, users or a schedule."]})
        if step["after_minutes"] < previous:
            raise ValidationError({"steps": [f"steps[{index}]: after_minutes ({step['after_minutes']}) comes before "
                                             f"the previous step's ({previous}): steps run in order."]})
        previous = step["after_minutes"]


def policy_snapshot(policy: EscalationPolicy) -> dict:
    return {**snapshot(policy), "steps": [
        {"after_minutes": s.after_minutes, "receivers": sorted(r.name for r in s.receivers.all()),
         "users": sorted(u.username for u in s.users.all()), "schedule": s.schedule.name if s.schedule else None}
        for s in policy.steps.all()]}


def policy_save(*, instance: EscalationPolicy | None, fields: dict, steps: list[dict], actor) -> EscalationPolicy:
    """Create or replace a policy with its steps, each {"after_minutes", "receivers", "users",
    "schedule"} (model instances already looked up)."""
    clean_steps(steps)
    policy = instance or EscalationPolicy()
    before = policy_snapshot(instance) if instance else None
    for name, value in fields.items():
        setattr(policy, name, value)
    try:
        with transaction.atomic():
            policy.save()
            policy.steps.all().delete()
            for position, step in enumerate(steps):
                row = EscalationStep.objects.create(policy=policy, position=position,
                                                    after_minutes=step["after_minutes"], schedule=step["schedule"])
                row.receivers.set(step["receivers"])
                row.users.set(step["users"])
            audit_record(actor=actor, action="escalation_policy.update" if before else "escalation_policy.create",
                         obj=policy, before=before, after=policy_snapshot(policy))
    except IntegrityError:
        raise Conflict(f"An escalation policy named {policy.name!r} already exists.") from None
    return policy


def policy_delete(*, policy: EscalationPolicy, actor) -> None:
    try:
        with transaction.atomic():
            audit_record(actor=actor, action="escalation_policy.delete", obj=policy, before=policy_snapshot(policy))
            policy.delete()
    except ProtectedError:
        routes = ", ".join(str(pk) for pk in policy.routes.values_list("pk", flat=True))
        raise Conflict(f"Escalation policy {policy.name!r} is used by route {routes}: point it elsewhere first.") \
            from None
