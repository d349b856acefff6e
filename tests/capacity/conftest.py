"""Fixtures of the capacity suite: the SLO suite's deployment (a version whose artifact is nowhere)."""

from __future__ import annotations

from tests.slo.conftest import deployment, fast_password_hashing  # noqa: F401
