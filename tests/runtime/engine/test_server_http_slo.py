"""SLO scheduling through the replica's HTTP API on the real tiny engine: targets from the admin API
and the gateway's headers, late refusals as 503 + Retry-After, what /metrics shows, and greedy output
unchanged by the policy. Timings are the benchmark's business (bench/engine/slo_bench.py); a refusal
here is made certain with a 1 µs TTFT target, past before the engine first sees the request (a request
alone on an idle engine is refused only then: otherwise it gets its best chance whatever the estimate)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.engine.sampling import SamplingParams
from runtime.engine.server.settings import SloTargetSettings
from runtime.engine.slo_scheduling import SloTargets
from runtime.gateway.contract import SLO_LATE, SLO_TPOT_HEADER, SLO_TTFT_HEADER
from tests.runtime.engine.replica_http import GREEDY, make_client, parse_serve_args, sse_events, wait_ready

ADMIN = {"Authorization": "Bearer s3cret"}
DEFAULTS = SloTargets.from_ms(2000, 200)


@pytest.fixture
def slo_client(make_engine):
    """A replica under --scheduling-policy slo --slo-reject-late."""
    engine = make_engine(max_model_len=64, scheduling_policy="slo", slo_reject_late=True)
    test_client, _ = make_client(lambda: engine, admin_token="s3cret", scheduling_policy="slo",
                                 slo_reject_late=True, slo_targets=SloTargetSettings(DEFAULTS))
    with test_client:
        wait_ready(test_client)
        yield test_client


def samples(client) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}


def value(client, name: str, **labels) -> float:
    wanted = {"engine": "0", "model_name": "tiny", **labels}
    return samples(client).get((name, tuple(sorted(wanted.items()))), 0.0)


def test_a_request_that_cannot_meet_its_ttft_is_refused_with_503_and_retry_after(slo_client):
    body = {"prompt": "hello there", "max_tokens": 4, **GREEDY}
    refused = slo_client.post("/v1/completions", json=body, headers={SLO_TTFT_HEADER: "0.001"})
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == SLO_LATE and error["type"] == "ServiceUnavailableError"
    assert "time-to-first-token" in error["message"]
    # A stream is refused the same way: its headers wait for its first token.
    streamed = slo_client.post("/v1/chat/completions", headers={SLO_TTFT_HEADER: "0.001"},
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                     "stream": True, **GREEDY})
    assert streamed.status_code == 503 and streamed.json()["error"]["code"] == SLO_LATE
    assert value(slo_client, "inferops:slo_rejected_late_total") == 2
    # Neither was served, so neither counts as a success or is judged.
    assert value(slo_client, "vllm:request_success_total", finished_reason="length") == 0
    assert value(slo_client, "inferops:slo_requests_judged_total") == 0
    # A request with room to spare is served, streamed or not, and judged.
    assert slo_client.post("/v1/completions", json=body).status_code == 200
    ok = slo_client.post("/v1/completions", json={**body, "stream": True})
    assert ok.status_code == 200 and sse_events(ok.text)[-1]["choices"][0]["finish_reason"] == "length"
    assert value(slo_client, "inferops:slo_requests_judged_total") == 2
    assert value(slo_client, "inferops:slo_admission_slack_seconds_bucket", le="+Inf") == 2


def test_control_plane_targets_apply_without_a_restart_and_headers_win(slo_client):
    assert slo_client.get("/admin/slo-targets", headers=ADMIN).json() == {
        "ttft_ms": 2000.0, "tpot_ms": 200.0, "source": "engine"}
    assert value(slo_client, "inferops:slo_target_ttft_seconds") == 2.0
    body = {"prompt": "hello", "max_tokens": 3, **GREEDY}
    changed = slo_client.post("/admin/slo-targets", headers=ADMIN, json={"ttft_ms": 0.001})
    assert changed.json() == {"ttft_ms": 0.001, "tpot_ms": 200.0, "source": "control-plane"}
    assert value(slo_client, "inferops:slo_target_ttft_seconds") == 0.000001
    assert slo_client.post("/v1/completions", json=body).status_code == 503
    # The gateway's header (a tenant's SLO) wins over the replica's targets.
    assert slo_client.post("/v1/completions", json=body, headers={SLO_TTFT_HEADER: "60000"}).status_code == 200
    back = slo_client.post("/admin/slo-targets", headers=ADMIN, json={"ttft_ms": None, "tpot_ms": None})
    assert back.json()["source"] == "engine"
    assert slo_client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("body, field", [
    ({"ttft_ms": 0}, "ttft_ms"), ({"ttft_ms": -5}, "ttft_ms"), ({"tpot_ms": "fast"}, "tpot_ms"),
    ({"tpot_ms": True}, "tpot_ms"), ({"ttft_ms": 1e12}, "ttft_ms"), ({"deadline": 5}, "deadline"),
    ([1, 2], "body"),
])
def test_bad_targets_are_refused_and_change_nothing(slo_client, body, field):
    before = slo_client.get("/admin/slo-targets", headers=ADMIN).json()
    response = slo_client.post("/admin/slo-targets", headers=ADMIN, json={"tpot_ms": 50, **body}
                               if isinstance(body, dict) else body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert slo_client.get("/admin/slo-targets", headers=ADMIN).json() == before


def test_slo_targets_need_the_admin_token(slo_client):
    assert slo_client.get("/admin/slo-targets").status_code == 401
    assert slo_client.post("/admin/slo-targets", json={"ttft_ms": 1},
                           headers={"Authorization": "Bearer wrong"}).status_code == 401


@pytest.mark.parametrize("header, text", [(SLO_TTFT_HEADER, "soon"), (SLO_TPOT_HEADER, "-1"),
                                          (SLO_TTFT_HEADER, "nan"), (SLO_TPOT_HEADER, "inf")])
def test_a_malformed_target_header_is_a_400_naming_it(slo_client, header, text):
    response = slo_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                               headers={header: text})
    assert response.status_code == 400 and response.json()["error"]["param"] == header


def test_deadline_misses_are_counted_by_phase_under_any_policy(client):
    """The default policy (priority) is judged too, so operators can compare policies."""
    body = {"prompt": "hello", "max_tokens": 4, **GREEDY}
    assert client.post("/v1/completions", json=body, headers={SLO_TTFT_HEADER: "0.001",
                                                              SLO_TPOT_HEADER: "0.001"}).status_code == 200
    assert client.post("/v1/completions", json=body, headers={SLO_TTFT_HEADER: "60000",
                                                              SLO_TPOT_HEADER: "60000"}).status_code == 200
    assert value(client, "inferops:slo_requests_judged_total") == 2
    assert value(client, "inferops:slo_deadline_misses_total", phase="ttft") == 1
    assert value(client, "inferops:slo_deadline_misses_total", phase="tpot") == 1
    assert value(client, "inferops:scheduling_policy_info", policy="priority") == 1
    # Only the slo policy measures slack at admission.
    assert not any(name.startswith("inferops:slo_admission_slack") for name, _ in samples(client))


def test_serve_options_reach_the_engine_and_the_settings():
    args, settings = parse_serve_args("--scheduling-policy", "slo", "--slo-ttft-ms", "1500",
                                      "--slo-tpot-ms", "120", "--slo-reject-late")
    assert settings.scheduling_policy == "slo" and settings.slo_reject_late
    assert settings.slo_targets.effective == SloTargets(1.5, 0.12)
    _, settings = parse_serve_args("--slo-reject-late")  # only meaningful under slo
    assert not settings.slo_reject_late
    with pytest.raises(SystemExit):
        parse_serve_args("--scheduling-policy", "edf")
    with pytest.raises(SystemExit):
        parse_serve_args("--slo-ttft-ms", "0")


def test_greedy_output_is_the_same_token_for_token_under_every_policy(make_engine):
    """Each policy batches and chunks differently (slo sizes its steps from a 5 ms TPOT, so its
    prompts go through in small chunks); the tokens must not change."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "Paged", "Köln 東京 " * 4]
    outputs = {}
    for policy in ("fcfs", "priority", "slo"):
        engine = make_engine(scheduling_policy=policy, max_num_batched_tokens=32, slo_tpot_ms=5)
        prompts = [engine.tokenizer.encode(t) for t in texts]
        outputs[policy] = engine.generate(prompts, params)
    assert outputs["fcfs"] == outputs["priority"] == outputs["slo"]
    assert all(len(tokens) == 12 for tokens in outputs["slo"])
