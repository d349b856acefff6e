"""One health verdict per overview row (deployments/health.py), from plain values: every signal
and its level, the worst one wins, every reason is named (unhealthy ones first)."""

from __future__ import annotations

import pytest

from deployments.health import AT_RISK, HEALTHY, UNHEALTHY, health_verdict

FINE = {"status": "ready", "ready": 2, "desired": 2, "slos": [{"name": "ttft", "state": "ok"}],
        "degradation": None, "requests": 100, "error_rate": 0.0}


def verdict(**changes):
    return health_verdict(**{**FINE, **changes})


def test_a_ready_deployment_within_budget_is_healthy_with_no_reasons():
    result = verdict()
    assert (result.level, result.label, result.reasons, result.text) == (HEALTHY, "healthy", (), "")


def test_an_exhausted_budget_and_a_degradation_level_make_a_ready_deployment_unhealthy():
    result = verdict(slos=[{"name": "ttft", "state": "exhausted"}, {"name": "availability", "state": "ok"}],
                     degradation={"level": 2, "name": "shed-batch"})
    assert result.level == UNHEALTHY and result.label == "unhealthy"
    assert result.text == "SLO ttft budget exhausted; degraded to level 2 (shed-batch)"


@pytest.mark.parametrize(("changes", "level", "reason"), [
    ({"slos": [{"name": "ttft", "state": "warning"}]}, AT_RISK, "SLO ttft budget burning"),
    ({"degradation": {"level": 1}}, AT_RISK, "degraded to level 1"),
    ({"ready": 1}, AT_RISK, "1 of 2 replicas ready"),
    ({"ready": 0}, UNHEALTHY, "no replica ready of 2"),
    ({"status": "failed", "ready": 0}, UNHEALTHY, "replicas failing"),
    ({"error_rate": 0.02}, AT_RISK, "2.0 % of requests failing"),
    ({"error_rate": 0.05}, UNHEALTHY, "5.0 % of requests failing"),
])
def test_each_signal_alone(changes, level, reason):
    result = verdict(**changes)
    assert (result.level, result.reasons) == (level, (reason,))


@pytest.mark.parametrize("changes", [
    {"slos": [{"name": "ttft", "state": "pending"}, {"name": "goodput", "state": "insufficient"}]},
    {"slos": []},
    {"degradation": {"level": 0, "name": "normal"}},
    {"error_rate": 0.009},
    {"requests": 19, "error_rate": 0.5},  # one failure among a handful of requests is noise
    {"requests": 0, "error_rate": None},
    {"ready": 0, "desired": 0},  # scaled to zero on purpose
])
def test_what_does_not_count_against_health(changes):
    assert verdict(**changes).level == HEALTHY


def test_the_worst_level_wins_and_unhealthy_reasons_come_first():
    result = verdict(ready=1, degradation={"level": 1}, slos=[{"name": "ttft", "state": "warning"},
                                                              {"name": "availability", "state": "exhausted"}])
    assert result.level == UNHEALTHY
    assert result.reasons == ("SLO availability budget exhausted", "1 of 2 replicas ready", "SLO ttft budget burning",
                              "degraded to level 1")
