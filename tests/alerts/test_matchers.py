"""Malformed matchers are refused, in routes and silences alike, through the REST API (a 400 naming
the field and the matcher) and the console forms (the error beside the field naming the line,
everything else typed kept), and nothing is written. `deployment==demo` was once stored as
`deployment="=demo"`, a route that never matched; Alertmanager's own matcher syntax is the
reference (`name=value`, `name!=value`, `name=~regex`, `name!~regex`, quoted values allowed)."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from alerts import services
from alerts.matchers import parse_line
from alerts.models import Receiver, Route, Silence
from alerts.routing.dispatch import Tree, default_route
from inferops.models import AuditEvent

pytestmark = pytest.mark.django_db

ROUTES, SILENCES = "/api/v1/routes/", "/api/v1/silences/"


def iso(delta: timedelta) -> str:
    return (timezone.now() + delta).isoformat()


def by_index(errors) -> dict[int, dict]:
    """A nested list's errors by item: DRF answers a list with {} for good items, or (a PATCH) a
    dict keyed by index."""
    return {int(i): e for i, e in errors.items() if e} if isinstance(errors, dict) else \
        {i: e for i, e in enumerate(errors) if e}


def nothing_written() -> bool:
    return (not Route.objects.filter(is_default=False).exists() and not Silence.objects.exists()
            and not AuditEvent.objects.filter(action__startswith="route.").exists()
            and not AuditEvent.objects.filter(action__startswith="silence.").exists())


# ---------------------------------------------------------------------------- the line syntax

# (line typed in a form, what the error says after "Line N: ")
BAD_LINES = [
    ("deployment==demo", "deployment==demo: '=demo' begins with '=': a mistyped operator (deployment==)?"),
    ("deployment=!demo", "'!demo' begins with '!': a mistyped operator (deployment=!)?"),
    ("deployment!==demo", "'=demo' begins with '=': a mistyped operator (deployment!==)?"),
    ("deployment=~=demo", "'=demo' begins with '='"),
    ("deployment=~~demo", "'~demo' begins with '~'"),
    ('deployment="=demo"', "'=demo' begins with '='"),  # quoting a typo does not make it mean something
    ("deployment=~chat(", "'chat(' is not a valid regular expression for =~: missing )"),
    ("deployment!~[a-", "'[a-' is not a valid regular expression for !~"),
    ("deployment=~", 'no value after =~ (deployment=~"" matches an empty or missing label)'),
    ("deployment!~", "no value after !~"),
    ("deployment=", 'no value after = (deployment="" matches an empty or missing label)'),
    ("=demo", "=demo: Empty label name."),
    ('""=demo', "Empty label name."),
    ("bad-name=x", "'bad-name' is not a label name: letters, digits and underscores"),
    ("1st=x", "'1st' is not a label name"),
    ('deployment="demo', "the quoted text '\"demo' is not closed"),
    ('deployment="demo", severity="page"', "after the closing quote: ', severity=\"page\"' (one matcher per line)"),
    ("deployment~=demo", "'deployment~=demo' is not name=value, name!=value, name=~regex or name!~regex."),
    ("deployment", "'deployment' is not name=value"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_malformed_line_is_refused_saying_why(line, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_line(line)


@pytest.mark.parametrize(("line", "parsed"), [
    ("deployment=demo", ("deployment", "=", "demo")),
    ("  deployment != demo  ", ("deployment", "!=", "demo")),
    ("tenant=~ac.*", ("tenant", "=~", "ac.*")),
    ("tenant!~ac|globex", ("tenant", "!~", "ac|globex")),
    ('severity="page"', ("severity", "=", "page")),
    ('"severity"="page"', ("severity", "=", "page")),  # Alertmanager allows a quoted name
    ('deployment=""', ("deployment", "=", "")),
    (r'instance=~"node-\\d+"', ("instance", "=~", r"node-\d+")),
    (r'summary="say \"hi\""', ("summary", "=", 'say "hi"')),
    ("summary=TTFT above 2 s", ("summary", "=", "TTFT above 2 s")),
    ("deployment=demo=1", ("deployment", "=", "demo=1")),  # only the value's first character is checked
])
def test_well_formed_lines_read_as_alertmanager_reads_them(line, parsed):
    assert parse_line(line) == parsed


# ---------------------------------------------------------------------------- the REST API

# (route matcher, silence matcher, field of the matcher named in the error, words of the error)
BAD_MATCHERS = [
    ({"name": "deployment", "value": "demo", "op": "=="}, None, "op", '"==" is not an operator'),
    ({"name": "deployment", "value": "=demo", "op": "="},
     {"name": "deployment", "value": "=demo", "isRegex": False}, "value", "'=demo' begins with '='"),
    ({"name": "deployment", "value": "!demo", "op": "="},
     {"name": "deployment", "value": "!demo", "isRegex": False}, "value", "'!demo' begins with '!'"),
    ({"name": "deployment", "value": "~demo", "op": "!="},
     {"name": "deployment", "value": "~demo", "isRegex": False, "isEqual": False}, "value", "begins with '~'"),
    ({"name": "deployment", "value": "chat(", "op": "=~"},
     {"name": "deployment", "value": "chat(", "isRegex": True}, "value", "not a valid regular expression for =~"),
    ({"name": "deployment", "value": "[a-", "op": "!~"},
     {"name": "deployment", "value": "[a-", "isRegex": True, "isEqual": False}, "value",
     "not a valid regular expression for !~"),
    ({"name": "", "value": "demo", "op": "="}, {"name": "", "value": "demo", "isRegex": False}, "name",
     "Empty label name."),
    ({"name": "bad-name", "value": "demo", "op": "="}, {"name": "bad-name", "value": "demo", "isRegex": False},
     "name", "'bad-name' is not a label name"),
    ({"name": "deployment ", "value": "demo", "op": "="},
     {"name": "deployment ", "value": "demo", "isRegex": False}, "name", "'deployment ' is not a label name"),
]
ROUTE_CASES = [(route, field, words) for route, _, field, words in BAD_MATCHERS]
SILENCE_CASES = [(silence, field, words) for _, silence, field, words in BAD_MATCHERS if silence]
GOOD_ROUTE = {"name": "severity", "value": "page", "op": "="}
GOOD_SILENCE = {"name": "alertname", "value": "NodeDown", "isRegex": False, "isEqual": True}


@pytest.mark.parametrize(("matcher", "field", "words"), ROUTE_CASES)
def test_the_routes_api_refuses_a_malformed_matcher_naming_it(api, matcher, field, words):
    answer = api("operator").post(ROUTES, {"matchers": [GOOD_ROUTE, matcher]}, format="json")
    assert answer.status_code == 400, answer.json()
    errors = by_index(answer.json()["matchers"])
    assert set(errors) == {1}  # the good matcher is not blamed: the second one (index 1) is
    assert any(words in text for text in errors[1][field]), errors
    assert nothing_written()


@pytest.mark.parametrize(("matcher", "field", "words"), ROUTE_CASES)
def test_changing_a_route_to_a_malformed_matcher_changes_nothing(api, matcher, field, words):
    operator = api("operator")
    created = operator.post(ROUTES, {"matchers": [GOOD_ROUTE]}, format="json").json()
    answer = operator.patch(f"{ROUTES}{created['id']}/", {"matchers": [matcher]}, format="json")
    assert answer.status_code == 400
    assert any(words in text for text in by_index(answer.json()["matchers"])[0][field]), answer.json()
    assert Route.objects.get(pk=created["id"]).matchers == [GOOD_ROUTE]
    assert AuditEvent.objects.filter(action="route.update").count() == 0


def test_the_route_service_refuses_what_the_api_refuses():
    """The console and the API both end in route_save; a caller that skips the serializer meets the
    same checks."""
    from django.core.exceptions import ValidationError

    from alerts.routing.services import route_save

    with pytest.raises(ValidationError, match=re.escape("matchers[1] value: '=demo' begins with '='")):
        route_save(instance=None, actor=None,
                   fields={"matchers": [GOOD_ROUTE, {"name": "deployment", "value": "=demo", "op": "="}]})
    assert nothing_written()


@pytest.mark.parametrize(("matcher", "field", "words"), SILENCE_CASES)
def test_the_silences_api_refuses_a_malformed_matcher_naming_it(api, matcher, field, words):
    body = {"matchers": [GOOD_SILENCE, matcher], "endsAt": iso(timedelta(hours=2)), "createdBy": "ana",
            "comment": "maintenance"}
    answer = api("operator").post(SILENCES, body, format="json")
    assert answer.status_code == 400, answer.json()
    errors = by_index(answer.json()["matchers"])
    assert set(errors) == {1}  # the second matcher, by its index
    assert any(words in text for text in errors[1][field]), errors
    assert nothing_written()


def test_updating_a_silence_with_a_malformed_matcher_changes_nothing(api):
    operator = api("operator")
    body = {"matchers": [GOOD_SILENCE], "endsAt": iso(timedelta(hours=2)), "createdBy": "ana", "comment": "x"}
    created = operator.post(SILENCES, body, format="json").json()
    bad = {**body, "id": created["id"], "matchers": [{"name": "alertname", "value": "=NodeDown", "isRegex": False}]}
    answer = operator.post(SILENCES, bad, format="json")
    assert answer.status_code == 400 and "begins with '='" in by_index(answer.json()["matchers"])[0]["value"][0]
    assert [(s.pk, s.matchers) for s in Silence.objects.all()] == [(int(created["id"]), [GOOD_SILENCE])]


# ---------------------------------------------------------------------------- the console


@pytest.fixture
def operator(client, make_user):
    client.force_login(make_user("operator"))
    return client


def field_block(response, field: str) -> str:
    """The text of one field's block of a rendered form: its input and its errors."""
    text = response.content.decode()
    start = text.index(f'class="field field-{field}"')
    end = text.find('class="field field-', start + 10)
    return html.unescape(text[start:end if end > 0 else None])


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_the_route_form_names_the_bad_line_and_keeps_what_was_typed(operator, line, message):
    Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    typed = f"severity=page\n\n{line}"
    response = operator.post("/alerts/routes/new/", {
        "parent": str(default_route().pk), "position": "4", "matchers": typed, "receiver": "pager",
        "escalation_policy": "", "group_by": "alertname, tenant", "group_wait_s": "15", "group_interval_s": "",
        "repeat_interval_s": "", "continue_matching": "on"})
    assert response.status_code == 400
    matchers = field_block(response, "matchers")
    assert re.search(rf"Line 3: '?{re.escape(line)}", matchers) and message in matchers
    assert f">\n{typed}</textarea>" in matchers  # the text as typed, to fix in place
    assert '<option value="pager" selected>' in field_block(response, "receiver")
    assert 'value="alertname, tenant"' in field_block(response, "group_by")
    assert 'value="15"' in field_block(response, "group_wait_s")
    assert 'value="4"' in field_block(response, "position")
    assert "checked" in field_block(response, "continue_matching")
    assert nothing_written()


def test_the_route_form_names_every_bad_line(operator):
    response = operator.post("/alerts/routes/new/", {
        "parent": str(default_route().pk), "position": "0", "matchers": "deployment==demo\nok=1\n=x",
        "receiver": "", "escalation_policy": "", "group_by": ""})
    errors = field_block(response, "matchers")
    assert "Line 1: deployment==demo:" in errors and "Line 3: =x: Empty label name." in errors
    assert "Line 2" not in errors
    assert nothing_written()


def test_editing_a_route_with_a_bad_line_keeps_the_stored_route(operator):
    from alerts.routing.services import route_save

    route = route_save(instance=None, actor=None, fields={"matchers": [GOOD_ROUTE], "group_wait_s": 5})
    response = operator.post(f"/alerts/routes/{route.pk}/edit/", {
        "parent": str(default_route().pk), "position": "0", "matchers": "severity==page", "receiver": "",
        "escalation_policy": "", "group_by": "", "group_wait_s": "45"})
    assert response.status_code == 400 and "Line 1: severity==page:" in field_block(response, "matchers")
    assert 'value="45"' in field_block(response, "group_wait_s")
    route.refresh_from_db()
    assert (route.matchers, route.group_wait_s) == ([GOOD_ROUTE], 5)


def test_a_route_typed_as_intended_matches_the_alerts_it_names(operator):
    """The bug's other half: deployment=demo, typed right, routes the demo deployment's alerts."""
    pager = Receiver.objects.create(name="pager", url="http://127.0.0.1:9/hook")
    response = operator.post("/alerts/routes/new/", {
        "parent": str(default_route().pk), "position": "0", "matchers": 'deployment=demo\nseverity!="ticket"',
        "receiver": "pager", "escalation_policy": "", "group_by": ""})
    assert response.status_code == 302
    route = Route.objects.get(is_default=False)
    assert route.matchers == [{"name": "deployment", "value": "demo", "op": "="},
                              {"name": "severity", "value": "ticket", "op": "!="}]
    tree = Tree()
    assert tree.match({"deployment": "demo", "severity": "page"}) == [route]
    assert tree.match({"deployment": "other", "severity": "page"}) == [default_route()]
    assert tree.notifier(route).receiver == pager


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_the_silence_form_names_the_bad_line_and_keeps_what_was_typed(operator, line, message):
    typed = f'alertname="NodeDown"\n{line}'
    response = operator.post("/alerts/silences/new/", {
        "matchers": typed, "starts": "", "ends": "3h", "comment": "kernel upgrade on node-1"})
    assert response.status_code == 400
    matchers = field_block(response, "matchers")
    assert re.search(rf"Line 2: '?{re.escape(line)}", matchers) and message in matchers
    assert f">\n{typed}</textarea>" in matchers
    assert 'value="3h"' in field_block(response, "ends")
    assert ">\nkernel upgrade on node-1</textarea>" in field_block(response, "comment")
    assert nothing_written()


def test_editing_a_silence_with_a_bad_line_keeps_the_stored_silence(operator):
    now = timezone.now()
    silence = Silence.objects.create(matchers=[GOOD_SILENCE], starts_at=now - timedelta(minutes=5),
                                     ends_at=now + timedelta(hours=1), created_by="ana", comment="maintenance")
    response = operator.post(f"/alerts/silences/{silence.pk}/edit/", {
        "matchers": "alertname==NodeDown", "starts": "", "ends": "3h", "comment": "longer"})
    assert response.status_code == 400 and "Line 1: alertname==NodeDown:" in field_block(response, "matchers")
    assert ">\nlonger</textarea>" in field_block(response, "comment")
    assert [(s.pk, s.matchers, s.comment) for s in Silence.objects.all()] == [
        (silence.pk, [GOOD_SILENCE], "maintenance")]


def test_a_silence_typed_as_intended_mutes_the_alert_it_names(operator):
    response = operator.post("/alerts/silences/new/", {
        "matchers": 'deployment=demo\ninstance=~"node-\\\\d+"', "starts": "", "ends": "1h", "comment": "deploy"})
    assert response.status_code == 302
    silence = Silence.objects.get()
    assert silence.matchers == [
        {"name": "deployment", "value": "demo", "isRegex": False, "isEqual": True},
        {"name": "instance", "value": r"node-\d+", "isRegex": True, "isEqual": True}]
    muted = services.alert_raise(labels={"alertname": "NodeDown", "deployment": "demo", "instance": "node-12"},
                                 annotations={}, severity="page", now=timezone.now())
    loud = services.alert_raise(labels={"alertname": "NodeDown", "deployment": "demo", "instance": "db-1"},
                                annotations={}, severity="page", now=timezone.now())
    assert muted.events.filter(kind="muted").exists() and not loud.events.filter(kind="muted").exists()
