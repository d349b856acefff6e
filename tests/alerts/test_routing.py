"""Routing, grouping, escalation and repeats (alerts/routing/dispatch.py), driven with explicit times:
which routes take an alert, when a group is notified, one message per group and target, each
alert notified once per round, escalation that stops on acknowledgement, and the REST API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts import services
from alerts.models import Alert, AlertGroup, EscalationPolicy, Notification, Receiver, Route
from alerts.receivers.delivery import notification_deliver
from alerts.routing.dispatch import Tree, default_route, groups_advance, matcher_holds
from alerts.routing.services import route_save
from inferops.models import AuditEvent
from tests.reliability.test_rest_fuzz import assert_answer_matches_schema

pytestmark = pytest.mark.django_db

SECOND = timedelta(seconds=1)


def hook(name: str, url: str = "http://127.0.0.1:9/hook", **fields) -> Receiver:
    return Receiver.objects.create(name=name, url=url, **fields)


def route(receiver=None, policy=None, parent=None, **fields) -> Route:
    return route_save(instance=None, actor=None, fields={
        "receiver": receiver, "escalation_policy": policy, "parent": parent, **fields})


def fire(now, **labels) -> Alert:
    labels = {"alertname": "HighLatency", "severity": "page", **labels}
    return services.alert_raise(labels=labels, annotations={"summary": f"{labels}"}, severity=labels["severity"],
                                now=now)


def notified(alert, **target) -> list[tuple]:
    return sorted(Notification.objects.filter(alert=alert, **target).values_list("alert_status", "round"))


# ---------------------------------------------------------------------------- the tree


@pytest.mark.parametrize(("op", "value", "label", "holds"), [
    ("=", "acme", "acme", True), ("=", "acme", "beta", False), ("!=", "acme", "beta", True),
    ("=~", "ac.*", "acme", True), ("=~", "ac", "acme", False),  # anchored, as Alertmanager's
    ("!~", "ac.*", "acme", False), ("=", "", None, True), ("!=", "", None, False),  # missing reads as ""
])
def test_matchers_read_as_alertmanager_reads_them(op, value, label, holds):
    labels = {"tenant": label} if label is not None else {}
    assert matcher_holds({"name": "tenant", "value": value, "op": op}, labels) is holds


def test_the_first_matching_child_takes_an_alert_unless_it_says_continue():
    pager, acme, audit = hook("pager"), hook("acme-slack"), hook("audit")
    team = route(acme, matchers=[{"name": "tenant", "value": "acme", "op": "="}], position=0, continue_matching=True)
    pages = route(pager, matchers=[{"name": "severity", "value": "page"}], position=1)
    route(audit, position=2)  # a catch-all after the page route: never reached by pages
    nested = route(None, parent=pages, matchers=[{"name": "deployment", "value": "chat.*", "op": "=~"}])
    tree = Tree()
    assert tree.match({"severity": "page", "tenant": "acme"}) == [team, pages]  # continue, then pages
    assert tree.match({"severity": "page", "deployment": "chat-2"}) == [nested]  # the deepest that matches
    assert tree.match({"severity": "ticket"})[0].receiver == audit
    # Nested without a receiver: it notifies its parent's, and inherits its grouping.
    assert tree.notifier(nested) == pages
    assert tree.timing(nested).group_wait_s == default_route().group_wait_s
    Route.objects.filter(pk__in=[team.pk, pages.pk, nested.pk]).delete()
    Route.objects.exclude(is_default=True).delete()
    assert Tree().match({"severity": "page"}) == [default_route()]


def test_a_group_is_notified_after_group_wait_then_new_alerts_at_group_interval(webhook_receiver):
    receiver = hook("team", webhook_receiver.url)
    route(receiver, group_by=["deployment"], group_wait_s=30, group_interval_s=300,
          matchers=[{"name": "alertname", "value": "HighLatency"}])
    now = timezone.now()
    burst = [fire(now + i * SECOND, deployment="chat", instance=f"r{i}") for i in range(10)]
    other = fire(now, deployment="embed", instance="r0")
    assert not Notification.objects.exists()  # waiting: group_wait is 30 s
    assert groups_advance(now + 29 * SECOND) == {"flushed": 0, "rounds": 0}
    assert groups_advance(now + 30 * SECOND)["flushed"] == 2  # the chat group and the embed group

    # One message per group: the ten alerts of chat's group go together.
    lead = Notification.objects.filter(alert=burst[0]).get()
    result = notification_deliver(notification_id=lead.pk)
    assert (result.outcome, result.alerts) == ("sent", 10)
    assert notification_deliver(notification_id=Notification.objects.get(alert=other).pk).alerts == 1
    [chat, embed] = sorted((r["body"] for r in webhook_receiver.requests), key=lambda b: len(b["alerts"]),
                           reverse=True)
    assert chat["groupLabels"] == {"deployment": "chat"} and len(chat["alerts"]) == 10
    assert {a["labels"]["instance"] for a in chat["alerts"]} == {f"r{i}" for i in range(10)}
    assert embed["groupLabels"] == {"deployment": "embed"}
    # Every task of the group after the first finds nothing left: nothing is sent twice.
    assert {notification_deliver(notification_id=n.pk).outcome
            for n in Notification.objects.filter(alert__in=burst)} == {"skipped"}
    assert len(webhook_receiver.requests) == 2

    # A new alert in a notified group waits for group_interval after the last flush.
    late = fire(now + 60 * SECOND, deployment="chat", instance="r10")
    assert groups_advance(now + 329 * SECOND)["flushed"] == 0
    assert groups_advance(now + 330 * SECOND)["flushed"] == 1
    assert notified(late) == [("firing", 0)]
    assert Notification.objects.filter(alert__in=burst).count() == 10  # the others are not sent again


def test_an_escalation_policy_steps_up_until_someone_acknowledges(make_user):
    first, second = hook("primary-pager", kind="pagerduty", routing_key="k" * 32), hook("secondary-pager")
    lead = make_user("operator", "lead")
    lead.email = "lead@example.com"
    lead.save()
    policy = EscalationPolicy.objects.create(name="chat-oncall")
    step1 = policy.steps.create(position=0, after_minutes=0)
    step1.receivers.set([first])
    step2 = policy.steps.create(position=1, after_minutes=10)
    step2.receivers.set([second])
    step2.users.set([lead])
    route(None, policy, group_wait_s=0, repeat_interval_s=3600)
    now = timezone.now()
    alert = fire(now, deployment="chat")
    assert notified(alert) == [("firing", 0)]  # step 1 at once (group_wait 0)
    group = AlertGroup.objects.get()
    assert group.round_at == now + timedelta(minutes=10)
    assert groups_advance(now + timedelta(minutes=9))["rounds"] == 0

    # Ten minutes unacknowledged: step 2 notifies the secondary receiver and the lead by email.
    assert groups_advance(now + timedelta(minutes=10))["rounds"] == 1
    assert notified(alert, receiver=second) == [("firing", 1)] and notified(alert, user=lead) == [("firing", 1)]
    # After the last step, the last step repeats every repeat_interval.
    assert AlertGroup.objects.get().round_at == now + timedelta(minutes=70)

    # Acknowledged: everyone paged hears it (PagerDuty, and the lead by email; a plain webhook does
    # not take acknowledgements), and the escalation stops.
    services.alert_acknowledge(alert=alert, actor=lead)
    assert notified(alert, receiver=first) == [("acknowledged", 0), ("firing", 0)]
    assert ("acknowledged", 0) in notified(alert, user=lead)
    assert ("acknowledged", 0) not in notified(alert, receiver=second)
    assert groups_advance(now + timedelta(minutes=70))["rounds"] == 0
    assert AlertGroup.objects.get().round_at is None
    # Resolved: every target that heard of the firing hears of the end.
    services.alert_resolve(alert=Alert.objects.get(pk=alert.pk), now=now + timedelta(minutes=71))
    resolved = Notification.objects.filter(alert=alert, alert_status="resolved")
    assert {(n.receiver_id, n.user_id) for n in resolved} == {(first.pk, None), (second.pk, None), (None, lead.pk)}
    group = AlertGroup.objects.get()
    assert (group.round, group.first_notified_at, group.round_at) == (0, None, None)  # the next alert starts afresh


def test_an_escalation_step_pages_whoever_is_on_call(make_user):
    from alerts.models import LayerMember, Schedule, ScheduleLayer

    alice, bob = make_user("operator", "alice"), make_user("operator", "bob")
    for user in (alice, bob):
        user.email = f"{user.username}@example.com"
        user.save()
    now = timezone.now()
    schedule = Schedule.objects.create(name="primary")
    layer = ScheduleLayer.objects.create(schedule=schedule, position=0, rotation="daily",
                                         starts_at=now - timedelta(hours=1))
    LayerMember.objects.create(layer=layer, user=alice, position=0)
    LayerMember.objects.create(layer=layer, user=bob, position=1)
    policy = EscalationPolicy.objects.create(name="follow-the-schedule")
    policy.steps.create(position=0, after_minutes=0, schedule=schedule)
    route(None, policy, group_wait_s=0)
    alert = fire(now)
    assert list(Notification.objects.filter(alert=alert).values_list("user__username", flat=True)) == ["alice"]


def test_a_person_without_an_email_cannot_be_paged_and_the_timeline_says_so(make_user):
    nobody = make_user("operator", "no-mail")
    policy = EscalationPolicy.objects.create(name="to-nobody")
    policy.steps.create(position=0, after_minutes=0).users.set([nobody])
    route(None, policy, group_wait_s=0)
    alert = fire(timezone.now())
    assert not Notification.objects.exists()
    assert "cannot page no-mail: no email address" in alert.events.get(kind="notify-failed").text


def test_a_plain_receiver_route_repeats_while_unacknowledged():
    receiver = hook("team")
    route(receiver, group_wait_s=0, repeat_interval_s=3600)
    now = timezone.now()
    alert = fire(now)
    assert groups_advance(now + timedelta(minutes=59))["rounds"] == 0
    assert groups_advance(now + timedelta(minutes=60))["rounds"] == 1
    assert notified(alert) == [("firing", 0), ("firing", 1)]
    # A beat that runs twice at once does each round once.
    assert groups_advance(now + timedelta(minutes=60))["rounds"] == 0


def test_a_silenced_alert_joins_its_group_but_notifies_no_one():
    from alerts.models import Silence

    receiver = hook("team")
    route(receiver, group_wait_s=0, group_by=["alertname"])
    now = timezone.now()
    Silence.objects.create(matchers=[{"name": "instance", "value": "r1", "isRegex": False, "isEqual": True}],
                           starts_at=now - SECOND, ends_at=now + timedelta(hours=1), created_by="t", comment="maint")
    loud, quiet = fire(now, instance="r0"), fire(now, instance="r1")
    assert notified(loud) == [("firing", 0)] and notified(quiet) == []
    assert quiet.groups.get() == loud.groups.get()


# ---------------------------------------------------------------------------- the API


ROUTES = "/api/v1/routes/"
POLICIES = "/api/v1/escalation-policies/"


def test_routes_api_builds_the_tree_and_viewers_only_read(api):
    operator, viewer = api("operator"), api("viewer")
    hook("pagerduty-main")
    created = operator.post(ROUTES, {"matchers": [{"name": "severity", "value": "page", "op": "="}],
                                     "receiver": "pagerduty-main", "group_by": ["alertname", "deployment"],
                                     "group_wait_s": 10, "continue": True, "position": 1}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    default = default_route()
    assert body["parent"] == default.pk and body["continue"] is True and body["group_interval_s"] is None
    child = operator.post(ROUTES, {"parent": body["id"], "matchers": [{"name": "tenant", "value": "ac.*",
                                                                        "op": "=~"}]}, format="json")
    assert child.status_code == 201
    listed = viewer.get(ROUTES).json()
    assert [r["id"] for r in listed] == [default.pk, body["id"], child.json()["id"]] and listed[0]["is_default"]
    assert viewer.post(ROUTES, {}, format="json").status_code == 403
    changed = operator.patch(f"{ROUTES}{body['id']}/", {"group_wait_s": 0}, format="json")
    assert changed.status_code == 200 and changed.json()["group_wait_s"] == 0
    assert changed.json()["receiver"] == "pagerduty-main"  # a PATCH keeps what it does not name
    assert AuditEvent.objects.filter(action__in=["route.create", "route.update"]).count() == 3
    # The default route stays, and its grouping can change.
    assert operator.delete(f"{ROUTES}{default.pk}/").status_code == 409
    assert operator.patch(f"{ROUTES}{default.pk}/", {"group_wait_s": 5}, format="json").status_code == 200
    # Deleting a route takes its children with it.
    assert operator.delete(f"{ROUTES}{body['id']}/").status_code == 204
    assert Route.objects.count() == 1


@pytest.mark.parametrize(("payload", "field"), [
    ({"matchers": [{"name": "severity", "value": "page", "op": "=="}]}, "matchers"),
    ({"matchers": [{"name": "bad-name", "value": "x"}]}, "matchers"),
    ({"matchers": [{"name": "x", "value": "(", "op": "=~"}]}, "matchers"),
    ({"matchers": [{"name": "x", "value": "y", "isRegex": True}]}, "matchers"),
    ({"matchers": "severity=page"}, "matchers"),
    ({"receiver": "nope"}, "receiver"),
    ({"escalation_policy": "nope"}, "escalation_policy"),
    ({"group_by": ["...", "alertname"]}, "group_by"),
    ({"group_by": "alertname"}, "group_by"),
    ({"group_wait_s": -1}, "group_wait_s"),
    ({"group_wait_s": "soon"}, "group_wait_s"),
    ({"repeat_interval_s": 5}, "repeat_interval_s"),
    ({"continue": "yes"}, "continue"),
    ({"parent": 999999}, "parent"),
    ({"recevier": "x"}, "recevier"),
])
def test_routes_api_rejects_bad_input_naming_the_field(api, payload, field):
    answer = api("operator").post(ROUTES, payload, format="json")
    assert answer.status_code == 400 and field in answer.json(), answer.json()
    assert not Route.objects.filter(is_default=False).exists()


def test_a_route_names_one_target_and_cannot_sit_under_itself(api):
    operator = api("operator")
    hook("r1")
    EscalationPolicy.objects.create(name="p1").steps.create(position=0, after_minutes=0)
    both = operator.post(ROUTES, {"receiver": "r1", "escalation_policy": "p1"}, format="json")
    assert both.status_code == 400 and "receiver" in both.json()
    parent = operator.post(ROUTES, {"receiver": "r1"}, format="json").json()
    child = operator.post(ROUTES, {"parent": parent["id"]}, format="json").json()
    loop = operator.patch(f"{ROUTES}{parent['id']}/", {"parent": child["id"]}, format="json")
    assert loop.status_code == 400 and "parent" in loop.json()
    default = default_route()
    assert operator.patch(f"{ROUTES}{default.pk}/", {"matchers": [{"name": "a", "value": "b"}]},
                          format="json").status_code == 400
    # A receiver a route sends to cannot be deleted from under it.
    answer = api("admin").delete(f"/api/v1/receivers/{Receiver.objects.get(name='r1').pk}/")
    assert answer.status_code == 409 and "route" in answer.json()["detail"]


def test_escalation_policies_api(api, make_user):
    operator = api("operator")
    hook("primary")
    make_user("viewer", "lead")
    from alerts.models import Schedule

    Schedule.objects.create(name="primary-rota")
    body = {"name": "chat-oncall", "description": "chat team", "steps": [
        {"after_minutes": 0, "receivers": ["primary"]},
        {"after_minutes": 15, "users": ["lead"], "schedule": "primary-rota"}]}
    created = operator.post(POLICIES, body, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["steps"] == [
        {"after_minutes": 0, "receivers": ["primary"], "users": [], "schedule": None},
        {"after_minutes": 15, "receivers": [], "users": ["lead"], "schedule": "primary-rota"}]
    assert operator.post(POLICIES, body, format="json").status_code == 409  # the name is taken
    replaced = operator.put(f"{POLICIES}chat-oncall/", {**body, "steps": body["steps"][:1]}, format="json")
    assert replaced.status_code == 200 and len(replaced.json()["steps"]) == 1
    for bad, field in [({**body, "steps": []}, "steps"),
                       ({**body, "steps": [{"after_minutes": 0}]}, "steps"),
                       ({**body, "steps": [{"after_minutes": 10, "receivers": ["primary"]},
                                           {"after_minutes": 5, "receivers": ["primary"]}]}, "steps"),
                       ({**body, "steps": [{"after_minutes": -1, "receivers": ["primary"]}]}, "steps"),
                       ({**body, "steps": [{"after_minutes": 0, "users": ["ghost"]}]}, "steps"),
                       ({**body, "name": "Bad Name"}, "name")]:
        answer = operator.post(POLICIES, {**bad, "name": bad["name"] if field == "name" else "other"}, format="json")
        assert answer.status_code == 400 and field in answer.json(), (bad, answer.json())
    assert api("viewer").get(POLICIES).status_code == 200
    # In use by a route: it stays.
    operator.post(ROUTES, {"escalation_policy": "chat-oncall"}, format="json")
    assert operator.delete(f"{POLICIES}chat-oncall/").status_code == 409
    Route.objects.filter(escalation_policy__name="chat-oncall").delete()
    assert operator.delete(f"{POLICIES}chat-oncall/").status_code == 204


def test_the_alert_page_says_where_the_alert_was_routed_and_what_comes_next(client, make_user):
    pager = hook("pager")
    policy = EscalationPolicy.objects.create(name="chat-oncall")
    policy.steps.create(position=0, after_minutes=0).receivers.set([pager])
    policy.steps.create(position=1, after_minutes=15).receivers.set([pager])
    route(None, policy, group_wait_s=0, group_by=["deployment"])
    alert = fire(timezone.now(), deployment="chat")
    client.force_login(make_user("viewer"))
    text = client.get(f"/alerts/{alert.pk}/").content.decode()
    assert 'id="alert-routing"' in text and "escalation policy chat-oncall (step 1 of 2)" in text
    assert "unacknowledged: notifies again at" in text and 'deployment="chat"' in text


def test_an_escalation_policy_naming_a_receiver_with_a_nul_is_a_400_not_a_500(api):
    # Found by the REST fuzzer (issue 40): the receiver was looked up by a name psycopg cannot send.
    response = api("operator").post(POLICIES, {"name": "p", "steps": [{"after_minutes": 0, "receivers": ["a\x00b"]}]},
                                    format="json")
    assert response.status_code == 400 and response.json() == {"steps": ["Null characters are not allowed."]}
    assert not EscalationPolicy.objects.exists()
    assert_answer_matches_schema(response, "POST", POLICIES)
