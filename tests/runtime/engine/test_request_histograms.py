"""vLLM's per-request length and phase histograms on the replica's /metrics, so vLLM's own
dashboard panels (request lengths, prefill and decode time) fill in for built-in replicas too."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.runtime.engine.replica_http import GREEDY, make_client, wait_ready

PHASES = ("vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
          "vllm:request_inference_time_seconds", "vllm:request_queue_time_seconds")


def samples(client) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("le")): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples}


def test_request_lengths_and_phases_are_observed_per_request(make_engine):
    engine = make_engine(max_model_len=64)
    prompt_len = len(engine.tokenizer.encode("hello there"))
    client, _ = make_client(lambda: engine)
    with client:
        wait_ready(client)
        for max_tokens in (3, 7):
            answer = client.post("/v1/completions",
                                 json={"prompt": "hello there", "max_tokens": max_tokens, **GREEDY})
            assert answer.status_code == 200, answer.text
        seen = samples(client)
    assert seen[("vllm:request_prompt_tokens_count", None)] == 2
    assert seen[("vllm:request_prompt_tokens_sum", None)] == 2 * prompt_len
    assert seen[("vllm:request_generation_tokens_sum", None)] == 3 + 7
    # 3 tokens fall at or below the 5 edge, 7 only at the 10 edge.
    assert seen[("vllm:request_generation_tokens_bucket", "5.0")] == 1
    assert seen[("vllm:request_generation_tokens_bucket", "10.0")] == 2
    for name in PHASES:
        assert seen[(f"{name}_count", None)] == 2, name
    prefill, decode, inference, queue = (seen[(f"{name}_sum", None)] for name in PHASES)
    # Both requests ran and decoded (queueing may take no time at all); prefill and decode split
    # the time a request ran, and queue plus run is its whole life.
    assert prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    assert queue + inference == pytest.approx(seen[("vllm:e2e_request_latency_seconds_sum", None)])


def test_aborted_and_refused_requests_leave_the_length_histograms_alone(make_engine):
    engine = make_engine(max_model_len=64)
    client, _ = make_client(lambda: engine)
    with client:
        wait_ready(client)
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 500})
        assert refused.status_code == 400
        seen = samples(client)
    assert seen[("vllm:request_prompt_tokens_count", None)] == 0
    assert seen[("vllm:request_prefill_time_seconds_count", None)] == 0


def test_new_families_match_vllms_buckets():
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[3] / "bench/scrape/vllm-0.32-cpu-metrics.txt"
    vllm = {f.name: f for f in text_string_to_metric_families(recorded.read_text())}
    from runtime.engine.metrics import ServerMetrics

    ours = {f.name: f for f in text_string_to_metric_families(
        ServerMetrics("tiny", lambda: None).render().decode())}
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", *PHASES):
        edges = [[s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")]
                 for fam in (ours[name], vllm[name])]
        assert ours[name].type == vllm[name].type == "histogram"
        assert edges[0] == edges[1], name
