"""The low-traffic guard: under an SLO's min_requests events its budget is not called exhausted,
no burn-rate alert fires and no rollout is refused on it (a new SLO with two slow requests)."""

from __future__ import annotations

import pytest

from alerts.models import Alert
from deployments.rollouts.services import _check_budget
from inferops.api import Conflict
from slo.budget import MINUTE, slo_state
from slo.evaluation import evaluate_slos
from slo.rollout_gate import exhausted_slos, insufficient_traffic_slos
from slo.services import slo_create
from tests.slo.conftest import NOW, event, insert_events

pytestmark = pytest.mark.django_db


def test_state_is_insufficient_under_the_minimum_and_judged_from_it():
    assert slo_state(-49.0, alert_firing=False, events=2, min_events=20) == "insufficient"
    assert slo_state(-49.0, alert_firing=True, events=19, min_events=20) == "insufficient"
    assert slo_state(-49.0, alert_firing=False, events=20, min_events=20) == "exhausted"
    assert slo_state(0.9, alert_firing=False, events=0, min_events=0) == "ok"
    assert slo_state(0.9, alert_firing=False) == "ok"  # no count given: judged as before


def latency_slo(deployment, **fields):
    return slo_create(actor=None, **{"name": "chat-ttft", "deployment": deployment, "sli_kind": "latency",
                                     "ttft_ms": 500.0, "objective": 0.99, "window": "30d", **fields})


def test_a_new_slo_with_two_slow_requests_is_not_exhausted(deployment):
    slo = latency_slo(deployment)
    insert_events([event(NOW, ttft_ms=2000.0), event(NOW, ttft_ms=2000.0)])
    evaluate_slos(now=NOW)
    slo.refresh_from_db()
    status = slo.status
    # The figure is what it is (2 bad events against a budget of 0.02), but nothing is judged on it.
    assert (status.good, status.total) == (0, 2) and status.budget_remaining == pytest.approx(1 - 2 / 0.02)
    assert status.state == "insufficient"
    assert status.burn_rates["5m"] == pytest.approx(100)  # far over 14.4x, and still no page
    assert not Alert.objects.exists()
    assert exhausted_slos(deployment) == []
    assert insufficient_traffic_slos(deployment) == [("chat-ttft", 2, 20)]
    _check_budget(deployment, rollback=False, override_reason="")  # no refusal

    # Once the window holds the minimum, the same budget is judged: exhausted, paged, gated.
    insert_events([event(NOW + MINUTE, ttft_ms=2000.0) for _ in range(18)])
    evaluate_slos(now=NOW + MINUTE)
    slo.refresh_from_db()
    assert slo.status.total == 20 and slo.status.state == "exhausted"
    assert Alert.objects.filter(slo=slo, status="firing", severity="page").exists()
    assert [name for name, _ in exhausted_slos(deployment)] == ["chat-ttft"]
    assert insufficient_traffic_slos(deployment) == []
    with pytest.raises(Conflict, match="chat-ttft"):
        _check_budget(deployment, rollback=False, override_reason="")


def test_the_minimum_is_per_slo_and_zero_judges_every_event(deployment):
    strict = latency_slo(deployment, name="chat-ttft-strict", min_requests=0)
    patient = latency_slo(deployment, name="chat-ttft-patient", min_requests=50)
    insert_events([event(NOW, ttft_ms=2000.0 if i < 3 else 100.0) for i in range(30)])
    evaluate_slos(now=NOW)
    strict.refresh_from_db()
    patient.refresh_from_db()
    assert strict.status.state == "exhausted"
    assert (patient.status.state, patient.status.total) == ("insufficient", 30)
    assert {alert.slo_id for alert in Alert.objects.filter(status="firing")} == {strict.pk}


def test_a_firing_alert_resolves_when_the_window_falls_under_the_minimum(deployment):
    """Raising the minimum above the traffic stops the judgement, alerts included."""
    from slo.services import slo_update

    slo = latency_slo(deployment, window="1d")
    insert_events([event(NOW, ttft_ms=2000.0) for _ in range(25)])
    evaluate_slos(now=NOW)
    assert Alert.objects.filter(slo=slo, status="firing").exists()
    slo_update(slo=slo, actor=None, min_requests=100)
    evaluate_slos(now=NOW + MINUTE)
    slo.refresh_from_db()
    assert slo.status.state == "insufficient"
    assert not Alert.objects.filter(slo=slo, status="firing").exists()
