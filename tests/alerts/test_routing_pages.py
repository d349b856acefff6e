"""Console pages of the routing tree and escalation policies: what viewers read, what operators
change, and bad input shown beside the form with nothing written."""

from __future__ import annotations

import re

import pytest
from django.utils import timezone

from alerts import services
from alerts.models import EscalationPolicy, Receiver, Route, Schedule
from alerts.routing.dispatch import default_route
from alerts.routing.services import policy_save, route_save
from inferops.models import AuditEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client, make_user):
    client.force_login(make_user("operator"))
    return client


def route_form(**fields) -> dict:
    return {"parent": str(default_route().pk), "position": "0", "matchers": "", "receiver": "",
            "escalation_policy": "", "group_by": "", "group_wait_s": "", "group_interval_s": "",
            "repeat_interval_s": "", **fields}


def children() -> list[Route]:
    return list(Route.objects.filter(is_default=False))


def text_of(response) -> str:
    return re.sub(r"\s+", " ", response.content.decode())


def test_viewers_read_the_tree_in_match_order_with_targets_and_effective_grouping(client, make_user):
    pager = Receiver.objects.create(name="pager", kind="pagerduty", url="http://127.0.0.1:9/pd", routing_key="k")
    slack = Receiver.objects.create(name="acme-slack", kind="slack", url="http://127.0.0.1:9/slack")
    user = make_user("viewer")
    policy = policy_save(instance=None, fields={"name": "db-oncall"}, actor=None,
                         steps=[{"after_minutes": 0, "receivers": [pager], "users": [user], "schedule": None}])
    later = route_save(instance=None, actor=None, fields={"receiver": slack, "position": 5, "matchers": [
        {"name": "tenant", "value": "ac.*", "op": "=~"}]})
    first = route_save(instance=None, actor=None, fields={"escalation_policy": policy, "position": 1,
                                                           "continue_matching": True, "group_wait_s": 10,
                                                           "matchers": [{"name": "severity", "value": "page"}]})
    nested = route_save(instance=None, actor=None, fields={"parent": first, "group_by": ["..."], "matchers": [
        {"name": "deployment", "value": "chat", "op": "!="}]})
    alert = services.alert_raise(labels={"alertname": "X", "severity": "page", "deployment": "chat"},
                                 annotations={}, severity="page", now=timezone.now())
    assert alert.groups.get().route == first

    client.force_login(user)
    response = client.get("/alerts/routes/")
    assert response.status_code == 200
    text = text_of(response)
    root = default_route()
    order = [text.index(f'id="route-{r.pk}"') for r in (root, first, nested, later)]
    assert order == sorted(order)  # default first, children in position order, nested under its parent
    assert "first</strong> child whose matchers all hold" in text and "continue" in text
    row = text[order[1]:order[2]]
    assert 'severity=&quot;page&quot;' in row and "escalation policy db-oncall" in row
    assert 'href="/alerts/escalation-policies/#policy-db-oncall"' in row
    assert "10 s" in row and 'class="pill tag continue"' in row
    assert re.search(r"group_by:</span> <span class=\"mono\">alertname, slo, deployment</span> "
                     r"<span class=\"muted inherited\">\(inherited\)", row)
    assert '<td class="open-groups mono">1</td>' in row
    nested_row = text[order[2]:order[3]]
    assert 'deployment!=&quot;chat&quot;' in nested_row and "inherits:</span> <a" in nested_row
    assert "every label (...)" in nested_row and "padding-left:56px" in nested_row
    later_row = text[order[3]:]
    assert 'tenant=~&quot;ac.*&quot;' in later_row and "receiver acme-slack (Slack-compatible" in later_row
    assert "every active receiver" in text[order[0]:order[1]]
    # A viewer sees no buttons or forms, and cannot post.
    assert "/alerts/routes/new/" not in text and "/edit/" not in text and "/delete/" not in text
    assert "Delete" not in text
    assert client.get("/alerts/routes/new/").status_code == 403
    assert client.post("/alerts/routes/new/", route_form(matchers="a=b")).status_code == 403
    assert client.post(f"/alerts/routes/{later.pk}/delete/").status_code == 403
    assert client.post("/alerts/escalation-policies/new/", {"name": "x"}).status_code == 403
    assert client.post("/alerts/escalation-policies/db-oncall/delete/").status_code == 403
    assert Route.objects.count() == 4 and EscalationPolicy.objects.count() == 1
    policies = text_of(client.get("/alerts/escalation-policies/"))
    assert "after 0 min: notify receivers pager, users viewer-user" in policies
    assert f'route {first.pk}: <span class="mono">severity=&quot;page&quot;</span>' in policies
    assert 'id="policy-new"' not in policies and "Delete" not in policies
    alerts_page = client.get("/alerts/").content.decode()
    assert 'id="routes-link"' in alerts_page and 'id="policies-link"' in alerts_page


def test_operator_adds_edits_and_deletes_a_route(operator):
    pager = Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    assert 'id="route-form"' in operator.get("/alerts/routes/new/").content.decode()
    response = operator.post("/alerts/routes/new/", route_form(
        matchers='severity="page"\n\ntenant=~ac.*\nteam!="db"', receiver="pager", group_by="alertname, tenant",
        group_wait_s="15", continue_matching="on", position="3"))
    assert response.status_code == 302 and response["Location"] == "/alerts/routes/"
    route = Route.objects.get(is_default=False)
    assert route.matchers == [{"name": "severity", "value": "page", "op": "="},
                              {"name": "tenant", "value": "ac.*", "op": "=~"},
                              {"name": "team", "value": "db", "op": "!="}]
    assert (route.receiver, route.group_by, route.group_wait_s, route.group_interval_s, route.continue_matching,
            route.position, route.parent_id) == (pager, ["alertname", "tenant"], 15, None, True, 3, default_route().pk)
    assert AuditEvent.objects.filter(action="route.create").count() == 1

    edit = operator.get(f"/alerts/routes/{route.pk}/edit/").content.decode()
    assert "severity=&quot;page&quot;\ntenant=~&quot;ac.*&quot;" in edit and 'value="15"' in edit
    response = operator.post(f"/alerts/routes/{route.pk}/edit/", route_form(
        matchers='severity="page"', receiver="pager", group_wait_s="45", position="3"))
    assert response.status_code == 302
    route.refresh_from_db()
    assert (route.matchers, route.group_wait_s, route.group_by, route.continue_matching) == (
        [{"name": "severity", "value": "page", "op": "="}], 45, None, False)

    child = route_save(instance=None, actor=None, fields={"parent": route})
    response = operator.post(f"/alerts/routes/{route.pk}/delete/", follow=True)
    assert f"Route {route.pk} deleted" in response.content.decode()
    assert not Route.objects.filter(pk__in=[route.pk, child.pk]).exists()
    assert AuditEvent.objects.filter(action="route.delete").count() == 1


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"matchers": "severity=page\nthis is not a matcher"}, "matchers", "Line 2: 'this is not a matcher' is not"),
    ({"matchers": "tenant=~ac(\n"}, "matchers", "Line 1: tenant=~ac(: 'ac(' is not a valid regular expression"),
    ({"receiver": "pager", "escalation_policy": "db"}, "receiver", "a receiver or an escalation policy, not both"),
    ({"group_by": "alertname, ..."}, "group_by", "it stands alone"),
    ({"group_wait_s": "soon"}, "group_wait_s", "Enter a whole number"),
    ({"repeat_interval_s": "5"}, "repeat_interval_s", "greater than or equal to 60"),
])
def test_bad_route_input_is_shown_beside_the_form_and_nothing_is_written(operator, fields, field, message):
    Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    EscalationPolicy.objects.create(name="db")
    data = route_form(**fields)
    response = operator.post("/alerts/routes/new/", data)
    assert response.status_code == 400
    text = response.content.decode()
    block = text[text.index(f'class="field field-{field}"'):]
    block = block[:block.index('class="field field-', 10)] if 'class="field field-' in block[10:] else block
    assert message in block.replace("&#x27;", "'")
    if fields.get("matchers"):
        assert fields["matchers"].split("\n")[0] in text  # what was typed stays
    assert children() == []
    assert not AuditEvent.objects.filter(action__startswith="route.").exists()


def test_a_route_cannot_sit_under_its_own_child(operator):
    parent = route_save(instance=None, actor=None, fields={"matchers": [{"name": "a", "value": "1"}]})
    child = route_save(instance=None, actor=None, fields={"parent": parent})
    response = operator.post(f"/alerts/routes/{parent.pk}/edit/", route_form(parent=str(child.pk)))
    assert response.status_code == 400
    assert "cannot sit under itself or one of its children" in response.content.decode()
    parent.refresh_from_db()
    assert parent.parent_id == default_route().pk


def test_the_default_route_is_edited_for_target_and_grouping_only_and_never_deleted(operator):
    root = default_route()
    Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    page = operator.get(f"/alerts/routes/{root.pk}/edit/").content.decode()
    assert 'name="group_wait_s"' in page and 'name="matchers"' not in page and 'name="parent"' not in page
    listing = operator.get("/alerts/routes/").content.decode()
    assert f'/alerts/routes/{root.pk}/edit/' in listing and f'/alerts/routes/{root.pk}/delete/' not in listing

    response = operator.post(f"/alerts/routes/{root.pk}/edit/", {"receiver": "pager", "group_by": "alertname",
                                                                 "group_wait_s": "5", "group_interval_s": "60",
                                                                 "repeat_interval_s": "3600"})
    assert response.status_code == 302
    root.refresh_from_db()
    assert (root.receiver.name, root.group_by, root.group_wait_s, root.repeat_interval_s) == (
        "pager", ["alertname"], 5, 3600)
    # The default route's grouping is what others inherit: it cannot be left empty.
    response = operator.post(f"/alerts/routes/{root.pk}/edit/", {"group_by": "", "group_wait_s": "",
                                                                 "group_interval_s": "60", "repeat_interval_s": "60"})
    assert response.status_code == 400 and "This field is required" in response.content.decode()
    response = operator.post(f"/alerts/routes/{root.pk}/delete/", follow=True)
    assert "The default route cannot be deleted" in response.content.decode()
    assert Route.objects.filter(pk=root.pk, is_default=True).exists()


def policy_form(name: str, rows: list[dict] | None = None, **fields) -> dict:
    data = {"name": name, "description": fields.pop("description", "")}
    for index, row in enumerate(rows or []):
        for key, value in row.items():
            data[f"step-{index}-{key}"] = value
    return data


def test_operator_creates_edits_and_deletes_a_policy(operator, make_user):
    Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    Receiver.objects.create(name="slack", url="http://127.0.0.1:9/hook")
    make_user("viewer", username="alice")
    Schedule.objects.create(name="primary")
    form = operator.get("/alerts/escalation-policies/new/").content.decode()
    assert form.count('class="step-form"') == 6

    response = operator.post("/alerts/escalation-policies/new/", policy_form("db-oncall", [
        {"after_minutes": "0", "receivers": ["pager", "slack"]},
        {},  # an empty row in between is ignored
        {"after_minutes": "10", "users": ["alice"], "schedule": "primary"},
    ], description="the database team"))
    assert response.status_code == 302, response.content.decode()
    policy = EscalationPolicy.objects.get()
    steps = list(policy.steps.all())
    assert [(s.after_minutes, sorted(r.name for r in s.receivers.all()), [u.username for u in s.users.all()],
             s.schedule and s.schedule.name) for s in steps] == [
        (0, ["pager", "slack"], [], None), (10, [], ["alice"], "primary")]
    listing = text_of(operator.get("/alerts/escalation-policies/"))
    assert "after 0 min: notify receivers pager, slack" in listing
    assert "after 10 min: notify users alice, whoever is on call in schedule primary" in listing
    assert "no route" in listing

    edit = operator.get("/alerts/escalation-policies/db-oncall/edit/").content.decode()
    assert 'value="db-oncall"' in edit and '<option value="primary" selected>' in edit
    response = operator.post("/alerts/escalation-policies/db-oncall/edit/", policy_form("db-oncall", [
        {"after_minutes": "0", "receivers": ["slack"]}]))
    assert response.status_code == 302
    assert [sorted(r.name for r in s.receivers.all()) for s in policy.steps.all()] == [["slack"]]

    used = route_save(instance=None, actor=None, fields={"escalation_policy": policy})
    response = operator.post("/alerts/escalation-policies/db-oncall/delete/", follow=True)
    assert f"is used by route {used.pk}" in response.content.decode()
    assert EscalationPolicy.objects.filter(pk=policy.pk).exists()
    Route.objects.filter(pk=used.pk).delete()
    response = operator.post("/alerts/escalation-policies/db-oncall/delete/", follow=True)
    assert "Escalation policy db-oncall deleted" in response.content.decode()
    assert not EscalationPolicy.objects.exists()


@pytest.mark.parametrize(("name", "rows", "message"), [
    ("db", [], "needs at least one step"),
    ("db", [{}, {"after_minutes": "5"}], "Step row 2: notify someone"),
    ("db", [{"after_minutes": "10", "receivers": ["pager"]}, {"after_minutes": "5", "receivers": ["pager"]}],
     "Step row 2: after_minutes (5) comes before"),
    ("db", [{"receivers": ["pager"]}], "After how many minutes?"),
    ("db", [{"after_minutes": "99999", "receivers": ["pager"]}], "Step row 1: after_minutes: Ensure"),
    ("Not A Slug", [{"after_minutes": "0", "receivers": ["pager"]}], "name"),
    ("taken", [{"after_minutes": "0", "receivers": ["pager"]}], "named &#x27;taken&#x27; already exists"),
])
def test_bad_policy_input_is_shown_on_the_page_and_nothing_is_written(operator, name, rows, message):
    Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    EscalationPolicy.objects.create(name="taken")
    response = operator.post("/alerts/escalation-policies/new/", policy_form(name, rows))
    assert response.status_code == 400
    text = response.content.decode()
    assert message in text
    assert f'value="{name}"' in text  # what was typed stays
    assert list(EscalationPolicy.objects.values_list("name", flat=True)) == ["taken"]
