"""Fault injection through the admin API, which a token guards."""

from __future__ import annotations

import time

from runtime.engine.server import FaultSettings
from tests.runtime.engine.replica_http import make_client, wait_ready


def test_admin_faults_requires_the_token(client):
    assert client.get("/admin/faults").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/admin/faults", json={"fault_ttft_ms": 5}, headers=wrong).status_code \
        == 401
    good = {"Authorization": "Bearer s3cret"}
    assert client.get("/admin/faults", headers=good).json() == {
        "fault_ttft_ms": 0.0, "fault_tpot_ms": 0.0, "fault_error_rate": 0.0}
    response = client.post("/admin/faults", json={"fault_error_rate": 1}, headers=good)
    assert response.json()["fault_error_rate"] == 1.0
    failed = client.post("/v1/completions", json={"prompt": "x"})
    assert failed.status_code == 500 and "Injected fault" in failed.json()["error"]["message"]
    bad = client.post("/admin/faults", json={"fault_error_rate": 2, "fault_ttft_ms": 1},
                      headers=good)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fault_error_rate"
    assert client.get("/admin/faults", headers=good).json()["fault_ttft_ms"] == 0.0


def test_admin_api_is_off_without_a_token(engine):
    test_client, _ = make_client(lambda: engine)
    with test_client:
        assert test_client.get("/admin/faults",
                               headers={"Authorization": "Bearer x"}).status_code == 404


def test_fault_ttft_delays_the_first_token(engine):
    test_client, _ = make_client(lambda: engine,
                                 faults=FaultSettings(fault_ttft_ms=300, fault_tpot_ms=0))
    with test_client:
        wait_ready(test_client)
        started = time.monotonic()
        test_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert time.monotonic() - started >= 0.3
