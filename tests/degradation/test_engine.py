"""The policy engine: one level per cycle, hysteresis, hold times, overrides; the level's actions
reach the deployment row (and so the routing table), the audit log, the timeline and an alert."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from alerts.models import Alert
from degradation import services
from degradation.engine import Level, decide
from degradation.models import DegradationState, LevelChange
from inferops.models import AuditEvent
from slo.budget import MINUTE
from slo.services import slo_create
from slo.tasks import evaluation_cycle
from tests.degradation.conftest import LEVELS
from tests.slo.conftest import NOW

HOLD = timedelta(seconds=60)
TWO = [Level("one", 5, 2), Level("two", 20, 10)]


def step(level, burn, since=None, now=NOW):
    return decide(level=level, since=since, worst_burn=burn, levels=TWO, hold=HOLD, now=now)


def test_decide_moves_one_level_per_cycle_with_hysteresis_and_hold():
    assert step(0, 100.0) == (1, "burn rate 100.00 reached one's entry rate 5")  # not straight to 2
    assert step(1, 100.0, since=NOW - HOLD)[0] == 2
    assert step(1, 100.0, since=NOW - HOLD + timedelta(seconds=1)) == (1, "")  # held
    assert step(0, 4.99) == (0, "")
    assert step(1, 3.0, since=NOW - HOLD) == (1, "")  # between exit and entry: stays (hysteresis)
    assert step(1, 1.99, since=NOW - HOLD)[0] == 0
    assert step(2, 9.0, since=NOW - HOLD)[0] == 1
    assert step(2, 25.0, since=NOW - HOLD) == (2, "")  # top level: nowhere higher
    assert step(1, 0.0, since=NOW - timedelta(seconds=10)) == (1, "")  # never leaves before the hold
    # Without enough traffic to measure: never up, and down only after a whole silent window (a
    # window that just rolled over, or traffic the level sheds, is no evidence the burn stopped).
    assert step(0, None) == (0, "")
    quiet = {"since": NOW - HOLD, "worst_burn": None, "level": 1, "levels": TWO, "hold": HOLD, "now": NOW,
             "window": timedelta(minutes=5)}
    assert decide(**quiet, measured_at=NOW - timedelta(minutes=4)) == (1, "")
    assert decide(**quiet, measured_at=NOW - timedelta(minutes=5)) == (
        0, "no watched SLO has had enough requests to show a burn for 5 min")
    assert decide(**quiet, measured_at=None)[0] == 0
    assert decide(level=3, since=NOW, worst_burn=50.0, levels=TWO, hold=HOLD, now=NOW)[0] == 2


@pytest.fixture
def setup(deployment, add_events):
    slo = slo_create(actor=None, name="chat-ttft", deployment=deployment, sli_kind="latency", ttft_ms=150,
                     objective=0.99, window="1d", min_requests=10)
    services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60, slos=[],
                         levels=LEVELS)
    return deployment, slo


def level_of(deployment) -> int:
    return DegradationState.objects.get(deployment=deployment).level


def test_a_burning_slo_raises_the_level_step_by_step_and_recovery_brings_it_back(setup, add_events):
    deployment, _ = setup
    # Half the requests miss the TTFT threshold: burn (0.5 / 0.01) = 50 over the 5 minute window.
    add_events(NOW, good=20, ttft_ms=100.0)
    add_events(NOW, good=20, ttft_ms=400.0)
    evaluation_cycle(now=NOW)
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 1 and state.burn_rates == {"chat-ttft": pytest.approx(50.0)}
    deployment.refresh_from_db()
    assert deployment.degradation == {"level": 1, "name": "shed-batch", "shed_below_priority": 5,
                                      "max_tokens_cap": None, "fallback": None, "scale_up": None,
                                      "freeze_rollouts": None, "retry_after_s": 60}
    alert = Alert.objects.get(labels__alertname="DeploymentDegraded", labels__deployment="chat")
    assert alert.status == "firing" and alert.severity == "ticket"
    assert "level 1 (shed-batch)" in alert.annotations["summary"]

    evaluation_cycle(now=NOW + timedelta(seconds=30))
    assert level_of(deployment) == 1  # held for 60 s
    evaluation_cycle(now=NOW + timedelta(seconds=61))
    assert level_of(deployment) == 2
    deployment.refresh_from_db()
    assert deployment.degradation["max_tokens_cap"] == 64 and deployment.degradation["freeze_rollouts"] is True

    # The bad minute leaves the 5 minute window; only good requests since.
    later = NOW + 6 * MINUTE
    add_events(later, good=30, ttft_ms=90.0)
    evaluation_cycle(now=later)
    assert level_of(deployment) == 1
    evaluation_cycle(now=later + timedelta(seconds=61))
    assert level_of(deployment) == 0
    deployment.refresh_from_db()
    assert deployment.degradation is None
    alert.refresh_from_db()
    assert alert.status == "resolved"

    changes = list(LevelChange.objects.filter(deployment=deployment).order_by("at"))
    assert [(c.from_level, c.to_level) for c in changes] == [(0, 1), (1, 2), (2, 1), (1, 0)]
    assert changes[0].burn_rates == {"chat-ttft": pytest.approx(50.0)} and "entry rate 5" in changes[0].reason
    assert "exit rate 2" in changes[-1].reason
    assert AuditEvent.objects.filter(action="degradation.level", object_id=str(deployment.pk)).count() == 4


def test_an_slo_below_its_min_requests_does_not_count(setup, add_events):
    deployment, _ = setup
    add_events(NOW, good=9, ttft_ms=900.0)  # all bad, but 9 < min_requests (10)
    evaluation_cycle(now=NOW)
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 0 and state.burn_rates == {}


def test_only_the_chosen_slos_are_watched(setup, add_events, deployment):
    _, ttft = setup
    availability = slo_create(actor=None, name="chat-availability", deployment=deployment,
                              sli_kind="availability", objective=0.99, window="1d", min_requests=10)
    services.policy_save(deployment=deployment, actor=None, enabled=True, window_minutes=5, hold_s=60,
                         slos=[availability], levels=LEVELS)
    add_events(NOW, good=40, ttft_ms=900.0)  # every TTFT bad, every request succeeded
    evaluation_cycle(now=NOW)
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 0 and state.burn_rates == {"chat-availability": 0.0}


def test_an_override_holds_a_level_until_it_expires(setup, add_events, make_user):
    deployment, _ = setup
    operator = make_user("operator")
    add_events(NOW, good=40, ttft_ms=900.0)
    services.override_set(deployment=deployment, actor=operator, level=0, until=NOW + timedelta(minutes=10),
                          reason="game day: watching it burn")
    evaluation_cycle(now=NOW)
    state = DegradationState.objects.get(deployment=deployment)
    assert state.level == 0 and state.burn_rates["chat-ttft"] == pytest.approx(100.0)  # seen, not acted on
    add_events(NOW + 10 * MINUTE, good=40, ttft_ms=900.0)  # still burning when it expires
    evaluation_cycle(now=NOW + timedelta(minutes=10, seconds=1))  # expired: the policy takes over
    state.refresh_from_db()
    assert state.level == 1 and state.override_until is None


def test_forcing_a_level_jumps_there_and_is_recorded_with_who_and_why(setup, make_user):
    deployment, _ = setup
    operator = make_user("operator")
    services.override_set(deployment=deployment, actor=operator, level=2,
                          until=timezone.now() + timedelta(hours=1), reason="launch day")
    change = LevelChange.objects.get(deployment=deployment)
    assert (change.from_level, change.to_level, change.actor) == (0, 2, operator)
    assert "forced by operator-user" in change.reason and "launch day" in change.reason
    deployment.refresh_from_db()
    assert deployment.degradation["level"] == 2
    assert AuditEvent.objects.filter(action="degradation.override", actor=operator).exists()


def test_a_deleted_deployment_goes_back_to_level_0_and_its_alert_resolves(setup, add_events):
    deployment, _ = setup
    add_events(NOW, good=40, ttft_ms=900.0)
    evaluation_cycle(now=NOW)
    assert level_of(deployment) == 1
    deployment.deleted_at = NOW
    deployment.save(update_fields=["deleted_at"])
    evaluation_cycle(now=NOW + timedelta(seconds=1))  # the hold does not keep a deleted deployment degraded
    assert level_of(deployment) == 0
    assert Alert.objects.get(labels__alertname="DeploymentDegraded").status == "resolved"


def test_a_level_re_entered_soon_after_leaving_it_is_held_twice_as_long(setup, add_events):
    deployment, _ = setup
    add_events(NOW, good=40, ttft_ms=900.0)
    evaluation_cycle(now=NOW)  # level 1, held 60 s
    # The level's shedding hides the overload: the next minute looks healthy and it steps down.
    add_events(NOW + MINUTE, good=40, ttft_ms=90.0)
    later = NOW + 6 * MINUTE
    add_events(later, good=40, ttft_ms=90.0)
    evaluation_cycle(now=later)
    assert level_of(deployment) == 0
    # The overload was still there: back within a window and a hold of leaving, a relapse.
    add_events(later + MINUTE, good=40, ttft_ms=900.0)
    evaluation_cycle(now=later + MINUTE)
    state = DegradationState.objects.get(deployment=deployment)
    assert (state.level, state.relapses) == (1, 1)
    assert "re-entered 60 s after leaving it, so it is held 120 s now" in LevelChange.objects.first().reason
    recovered = later + 7 * MINUTE
    add_events(recovered, good=40, ttft_ms=90.0)
    evaluation_cycle(now=recovered)
    assert level_of(deployment) == 0  # 6 minutes later: past the doubled hold
    # A burn long after is a new incident: a calm entry, the hold back to 60 s.
    much_later = recovered + timedelta(hours=1)
    add_events(much_later, good=40, ttft_ms=900.0)
    evaluation_cycle(now=much_later)
    state.refresh_from_db()
    assert (state.level, state.relapses) == (1, 0)
