"""The degradation panel on the deployment page and its console forms: viewers read, operators
change the policy and force levels through the API's serializers, errors shown with nothing written."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from degradation import services
from degradation.models import DegradationPolicy, DegradationState, LevelChange
from inferops.forms import error_lines
from slo.services import slo_create
from slo.tasks import evaluation_cycle
from tests.degradation.conftest import LEVELS

pytestmark = pytest.mark.django_db
PAGE = "/deployments/chat/"
POLICY = "/deployments/chat/degradation/policy/"
OVERRIDE = "/deployments/chat/degradation/override/"
CLEAR = "/deployments/chat/degradation/override/clear/"


@pytest.fixture
def slo(deployment):
    return slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
                      objective=0.99, window="1d", min_requests=10)


@pytest.fixture
def browser_as(make_user):
    def client_for(role: str) -> Client:
        client = Client()
        client.force_login(make_user(role))
        return client

    return client_for


@pytest.fixture
def policy(deployment, slo):
    return services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60,
                                slos=[slo], levels=LEVELS)


def policy_form(**fields) -> dict:
    form = {"policy-enabled": "on", "policy-window": "5m", "policy-hold_s": "60", "policy-slos": ["chat-ttft"],
            "policy-levels": json.dumps(LEVELS)}
    form.update(fields)
    return {key: value for key, value in form.items() if value is not None}


def chart_of(response) -> dict:
    match = re.search(r'<script id="degradation-data" type="application/json">(.*?)</script>',
                      response.content.decode(), re.S)
    assert match, "the chart's data are not on the page"
    return json.loads(match.group(1))


def test_a_viewer_reads_the_panel_without_forms(browser_as, deployment, policy):
    viewer = browser_as("viewer")
    page = viewer.get(PAGE).content.decode()
    assert 'id="degradation-level"' in page and "level 0 · normal" in page
    assert "shed-batch" in page and "short-answers" in page  # the levels table
    for form in ("degradation-policy-form", "degradation-override-form", "degradation-clear-form"):
        assert form not in page
    assert viewer.post(OVERRIDE, {"override-level": "1", "override-until": "30m",
                                  "override-reason": "x"}).status_code == 403
    assert viewer.post(POLICY, policy_form()).status_code == 403
    assert viewer.post(CLEAR).status_code == 403
    assert not LevelChange.objects.exists()


def test_without_a_policy_the_panel_says_so_and_offers_operators_the_form(browser_as, deployment, slo):
    viewer_page = browser_as("viewer").get(PAGE).content.decode()
    assert 'id="degradation-none"' in viewer_page and "degradation-policy-form" not in viewer_page
    operator_page = browser_as("operator").get(PAGE).content.decode()
    assert 'id="degradation-none"' in operator_page and 'id="degradation-policy-form"' in operator_page
    assert "shed-batch" in operator_page  # the example levels, ready to edit
    assert 'value="chat-ttft"' in operator_page  # the SLOs covering the deployment, to choose from


def test_an_operator_creates_and_edits_a_policy_through_the_form(browser_as, deployment, slo):
    operator = browser_as("operator")
    response = operator.post(POLICY, policy_form(**{"policy-window": "10m", "policy-hold_s": "120"}))
    assert response.status_code == 302 and response.url == "/deployments/chat/#degradation"
    policy = DegradationPolicy.objects.get(deployment=deployment)
    assert (policy.enabled, policy.window_minutes, policy.hold_s) == (True, 10, 120)
    assert [s.name for s in policy.slos.all()] == ["chat-ttft"]
    assert policy.levels[1] == {**LEVELS[1], "enter_burn_rate": 20.0, "exit_burn_rate": 10.0}
    page = operator.get(PAGE).content.decode()
    assert "Degradation policy of chat saved: 2 level(s), window 10m, hold 120 s." in page
    assert "level 0 · normal" in page and "Edit the policy" in page

    # Unticked checkbox: disabled; no SLO ticked: every SLO of the deployment.
    operator.post(POLICY, policy_form(**{"policy-enabled": None, "policy-slos": None}))
    policy.refresh_from_db()
    assert not policy.enabled and not policy.slos.exists()


@pytest.mark.parametrize(("fields", "message"), [
    ({"policy-levels": json.dumps([{**LEVELS[0], "exit_burn_rate": 6}])},
     "levels[0].exit_burn_rate: The exit rate (6) must not be above the entry rate (5)"),
    ({"policy-levels": json.dumps([LEVELS[1], LEVELS[0]])},
     "levels[1].enter_burn_rate: Levels must increase"),
    ({"policy-levels": json.dumps([{**LEVELS[0], "actions": {"fallback": {"deployment": "chat", "weight": 5}}}])},
     "levels[0].actions.fallback.deployment: A deployment cannot fall back to itself."),
    ({"policy-levels": json.dumps([{**LEVELS[0], "actions": {}}])}, "levels[0].actions: A level needs at least"),
    ({"policy-levels": "[{oops"}, "Not valid JSON"),
    ({"policy-levels": "[]"}, "Give 1 to 8 levels."),
    ({"policy-levels": " "}, "Give the levels: a JSON list"),
    ({"policy-window": "2h"}, "Give whole minutes from 1m to 1h"),
    ({"policy-hold_s": "soon"}, "A valid integer is required."),
    ({"policy-slos": ["nope"]}, "Unknown SLO &#x27;nope&#x27;; known for &#x27;chat&#x27;: chat-ttft."),
])
def test_a_bad_policy_shows_its_field_error_and_writes_nothing(browser_as, deployment, slo, fields, message):
    response = browser_as("operator").post(POLICY, policy_form(**fields))
    assert response.status_code == 400
    page = response.content.decode()
    assert message in page
    assert '<details id="degradation-policy" open>' in page  # the form stays open, with what was typed
    assert not DegradationPolicy.objects.exists() and not DegradationState.objects.exists()


def test_every_policy_error_shows_after_one_submit(browser_as, deployment, slo):
    """Levels that are not JSON no longer hide the serializer's verdict on the other fields."""
    operator = browser_as("operator")
    response = operator.post(POLICY, policy_form(**{
        "policy-levels": "[{oops", "policy-window": "2h", "policy-hold_s": "soon", "policy-slos": ["nope"]}))
    assert response.status_code == 400
    page = response.content.decode()
    for message in ("Not valid JSON", "Give whole minutes from 1m to 1h", "A valid integer is required.",
                    "Unknown SLO &#x27;nope&#x27;"):
        assert message in page
    assert "This field is required." not in page  # the levels' own error stands alone
    # Two bad levels: each named, with the window, at once.
    levels = [{**LEVELS[0], "exit_burn_rate": 6}, {**LEVELS[1], "enter_burn_rate": "lots"},
              {**LEVELS[1], "name": "elsewhere", "actions": {"fallback": {"deployment": "chat", "weight": 5}}}]
    page = operator.post(POLICY, policy_form(**{
        "policy-levels": json.dumps(levels), "policy-window": "90s"})).content.decode()
    assert "levels[0].exit_burn_rate: The exit rate (6) must not be above the entry rate (5)" in page
    assert "levels[1].enter_burn_rate: A valid number is required." in page
    assert "levels[2].actions.fallback.deployment: A deployment cannot fall back to itself." in page
    assert "Give whole minutes from 1m to 1h" in page
    assert not DegradationPolicy.objects.exists() and not DegradationState.objects.exists()


def test_error_lines_name_the_path_of_each_nested_message():
    errors = {"levels": [{}, {"actions": {"non_field_errors": ["needs one"], "fallback": {"weight": ["x"]}}}],
              "slos": ["unknown"]}
    assert [line for field, value in errors.items() for line in error_lines(value, field)] == [
        ("levels[1].actions", "needs one"), ("levels[1].actions.fallback.weight", "x"), ("slos", "unknown")]


def test_an_operator_forces_a_level_then_clears_the_override(browser_as, deployment, policy):
    operator = browser_as("operator")
    response = operator.post(OVERRIDE, {"override-level": "1", "override-until": "30m",
                                        "override-reason": "game day"})
    assert response.status_code == 302 and response.url == "/deployments/chat/#degradation"
    state = DegradationState.objects.get(deployment=deployment)
    assert (state.level, state.override_level, state.override_reason) == (1, 1, "game day")
    assert state.override_by.username == "operator-user"
    page = operator.get(PAGE).content.decode()
    assert "level 1 · shed-batch" in page and 'id="degradation-override"' in page and "game day" in page
    assert "requests below priority 5 get 503 degraded, Retry-After 60 s" in page  # the actions in force
    assert 'id="degradation-clear-form"' in page

    response = operator.post(CLEAR, {"reason": "done"})
    assert response.status_code == 302
    state.refresh_from_db()
    assert state.override_until is None and state.level == 1  # the policy decides at its next cycle
    page = operator.get(PAGE).content.decode()
    assert "Override of chat cleared" in page and 'id="degradation-override"' not in page
    # Nothing left to clear: said, not a server error.
    operator.post(CLEAR)
    assert "has no degradation override to clear" in operator.get(PAGE).content.decode()


@pytest.mark.parametrize(("fields", "message"), [
    ({"override-level": "3"}, "The policy has levels 0 to 2."),
    ({"override-until": "whenever"}, "Expected an ISO 8601 time or"),
    ({"override-until": "8d"}, "at most 7 days ahead"),
    ({"override-reason": ""}, "This field may not be blank."),
])
def test_a_bad_override_shows_its_field_error_and_writes_nothing(browser_as, deployment, policy, fields, message):
    form = {"override-level": "1", "override-until": "30m", "override-reason": "drill", **fields}
    response = browser_as("operator").post(OVERRIDE, form)
    assert response.status_code == 400 and message in response.content.decode()
    assert not LevelChange.objects.exists()
    assert DegradationState.objects.get(deployment=deployment).override_until is None


def test_override_without_a_policy_is_404(browser_as, deployment):
    response = browser_as("operator").post(OVERRIDE, {"override-level": "0", "override-until": "1h",
                                                      "override-reason": "x"})
    assert response.status_code == 404


def test_the_timeline_lists_the_level_changes_newest_first(browser_as, deployment, policy, make_user):
    operator = make_user("operator", username="alice")
    until = timezone.now() + timedelta(hours=1)
    services.override_set(deployment=deployment, actor=operator, level=2, until=until, reason="launch")
    services.override_set(deployment=deployment, actor=operator, level=0, until=until, reason="false alarm")
    page = browser_as("viewer").get(PAGE).content.decode()
    timeline = page[page.index('id="degradation-timeline"'):]
    rows = re.findall(r"<tr><td class=\"muted\">.*?</tr>", timeline, re.S)
    assert len(rows) == 2
    assert "2 short-answers → 0 normal" in rows[0] and "false alarm" in rows[0] and "alice" in rows[0]
    assert "0 normal → 2 short-answers" in rows[1] and "launch" in rows[1]


def test_the_chart_has_the_level_steps_and_the_burn_behind_them(browser_as, deployment, policy, add_events):
    now = timezone.now()
    # Half the requests miss the TTFT threshold: burn 0.5 / 0.01 = 50, and the engine enters level 1.
    add_events(now, good=20, ttft_ms=100.0)
    add_events(now, good=20, ttft_ms=400.0)
    evaluation_cycle(now=now)
    assert DegradationState.objects.get(deployment=deployment).level == 1
    response = browser_as("viewer").get(PAGE)
    chart = chart_of(response)
    burn = chart["burn"]["chat-ttft"]
    assert len(chart["times"]) == len(burn) == 15 + 1  # a fresh policy: every minute of the last 15
    assert burn[-1] == pytest.approx(50.0) and burn[0] is None  # no requests then: a gap, not a zero
    assert chart["level"]["y"] == [0, 1, 1]  # before, at the change, now
    assert chart["level_names"] == ["normal", "shed-batch", "short-answers"]
    assert chart["entry_rates"] == [{"name": "shed-batch", "rate": 5}, {"name": "short-answers", "rate": 20}]
    assert chart["window"] == "5m"
    assert 'id="degradation-chart"' in response.content.decode()


@pytest.mark.parametrize(("age", "minutes"), [(timedelta(0), 15), (timedelta(minutes=40), 40),
                                             (timedelta(days=2), 6 * 60)])
def test_the_chart_spans_the_policys_life_between_a_quarter_hour_and_six_hours(browser_as, policy, age, minutes):
    DegradationPolicy.objects.filter(pk=policy.pk).update(created_at=timezone.now() - age)
    chart = chart_of(browser_as("viewer").get(PAGE))
    assert len(chart["times"]) == minutes + 1
    assert chart["level"]["x"][0] == chart["times"][0]


def test_a_policy_posted_without_its_fields_is_refused_not_a_server_error(browser_as, deployment, slo):
    """Issue 40 (the permissions matrix): the levels box rendered back from no value at all was a 500."""
    response = browser_as("operator").post(POLICY, {})
    assert response.status_code in (302, 400), response.status_code
    assert not DegradationPolicy.objects.exists()
