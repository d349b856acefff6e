"""Fixtures of the degradation suite: the SLO suite's deployment and event rows, a policy helper."""

from __future__ import annotations

import pytest

from tests.slo.conftest import add_events, deployment, fast_password_hashing  # noqa: F401

LEVELS = [
    {"name": "shed-batch", "enter_burn_rate": 5, "exit_burn_rate": 2, "actions": {"shed_below_priority": 5}},
    {"name": "short-answers", "enter_burn_rate": 20, "exit_burn_rate": 10,
     "actions": {"shed_below_priority": 5, "max_tokens_cap": 64, "freeze_rollouts": True}},
]


@pytest.fixture
def policy_body():
    def body(**fields) -> dict:
        return {"enabled": True, "window": "5m", "hold_s": 60, "slos": [], "levels": LEVELS, **fields}

    return body
