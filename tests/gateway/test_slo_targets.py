"""The gateway sends a tenant's SLO targets to built-in replicas as headers, never a client's own, and
answers a replica's late refusal (503 slo_late) as it is: no retry, no ejection, booked as `late`.
Fake replicas stand in for the engine (the proxy alone is under test: a real engine's refusal needs an
overloaded model, which tests/e2e/test_slo_scheduling_e2e.py makes certain another way); Redis is real."""

from __future__ import annotations

import httpx
import pytest

from runtime.gateway.contract import LATE, SLO_LATE, SLO_TPOT_HEADER, SLO_TTFT_HEADER, slo_targets_field
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HTTP = httpx.Client(timeout=20)
PUBLISHED = 5.0  # a pub/sub hop, or the gateways' 1 s generation poll


def _post(base_url: str, secret: str, model: str = "demo", headers: dict | None = None, **body):
    return HTTP.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {secret}", **(headers or {})},
                     json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})


def test_a_tenants_targets_reach_built_in_replicas_and_a_clients_own_never_do(control, replicas, gateways):
    (replica,) = replicas(1)
    control.publish_route("demo", [(1, 100, [(replica.id, replica.url)])])
    control.publish_route("vllm-demo", [(1, 100, [(replica.id, replica.url)])], backend="vllm")
    acme, _ = control.publish_key("acme")
    other, _ = control.publish_key("globex")
    control.publish_slo_targets({slo_targets_field("demo", "acme"): {"ttft_ms": 1500, "tpot_ms": None},
                                 slo_targets_field("vllm-demo", "acme"): {"ttft_ms": 900, "tpot_ms": 90}})
    _, base_url = gateways()
    forged = {SLO_TTFT_HEADER: "99999", SLO_TPOT_HEADER: "99999"}

    def sent(secret, model="demo", **body) -> dict:
        assert _post(base_url, secret, model, headers=forged, **body).status_code == 200
        return {name: value for name, value in replica.headers[-1].items() if name.startswith("x-inferops-slo")}

    assert sent(acme) == {SLO_TTFT_HEADER: "1500"}
    assert sent(acme, stream=True) == {SLO_TTFT_HEADER: "1500"}
    assert sent(other) == {}  # no targets for this tenant: the replica's own apply
    assert sent(acme, "vllm-demo") == {}  # vLLM has no use for them

    # A changed table reaches the gateway without a restart.
    control.publish_slo_targets({slo_targets_field("demo", "acme"): {"ttft_ms": 800, "tpot_ms": 80}})
    wait_until(lambda: sent(acme) == {SLO_TTFT_HEADER: "800", SLO_TPOT_HEADER: "80"}, "the new targets", PUBLISHED)
    control.publish_slo_targets({})
    wait_until(lambda: sent(acme) == {}, "the targets gone", PUBLISHED)


@pytest.mark.parametrize("stream", [False, True])
def test_a_late_refusal_is_answered_as_it_is_and_booked_as_late(control, replicas, gateways, stream):
    first, second = replicas(2)
    first.behaviour.refuse_late = second.behaviour.refuse_late = True
    control.publish_route("demo", [(1, 100, [(first.id, first.url), (second.id, second.url)])])
    secret, _ = control.publish_key("acme")
    gateway, base_url = gateways()

    refused = _post(base_url, secret, stream=stream)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "3"
    assert refused.json()["error"]["code"] == SLO_LATE
    assert len(first.bodies) + len(second.bodies) == 1  # not retried on the other replica
    (event,) = control.wait_events(1)
    assert event["status"] == 503 and event["error_kind"] == LATE
    # Refusals are not failures of the replica: it is never ejected (the same prompt keeps going to
    # the replica that has its prefix, which an ejection would change), however many there are.
    chosen = first if first.bodies else second
    for _ in range(6):
        assert _post(base_url, secret, stream=stream).status_code == 503
    first.behaviour.refuse_late = second.behaviour.refuse_late = False
    assert {_post(base_url, secret, stream=stream).status_code for _ in range(4)} == {200}
    assert len(chosen.bodies) == 11 and len(first.bodies) + len(second.bodies) == 11
    metrics = HTTP.get(base_url.removesuffix("/v1") + "/metrics").text
    assert 'inferops_gateway_shed_total{deployment="demo",reason="late"} 7.0' in metrics
