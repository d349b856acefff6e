"""The replica's /metrics under vLLM's names, types, labels and buckets."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.runtime.engine.replica_http import GREEDY, MODEL, make_client


def test_metrics_follow_vllm_names(client, tokenizer):
    client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 4, **GREEDY})
    families = {f.name: f for f in text_string_to_metric_families(
        client.get("/metrics").text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert families[name].type == "histogram"
    samples = {(s.name, s.labels.get("finished_reason")): s for f in families.values()
               for s in f.samples}
    assert samples[("vllm:generation_tokens_total", None)].value == 4
    assert samples[("vllm:prompt_tokens_total", None)].value == len(tokenizer.encode("hey"))
    assert samples[("vllm:request_success_total", "length")].value == 1
    assert samples[("vllm:request_success_total", "abort")].value == 0
    assert samples[("vllm:time_to_first_token_seconds_count", None)].value == 1
    assert samples[("vllm:inter_token_latency_seconds_count", None)].value == 3
    assert samples[("vllm:num_requests_running", None)].labels == {"engine": "0",
                                                                   "model_name": MODEL}


def test_histogram_buckets_are_configurable(engine):
    test_client, _ = make_client(lambda: engine, histogram_buckets={"ttft": (0.5, 2.0)})
    with test_client:
        text = test_client.get("/metrics").text
    edges = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("vllm:time_to_first_token_seconds_bucket")]
    assert edges == ["0.5", "2.0", "+Inf"]


def test_metric_families_match_a_real_vllm_scrape(client):
    """Same names, types, label names and default buckets as vLLM 0.32's /metrics."""
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[3] / "bench/scrape/vllm-0.32-cpu-metrics.txt"
    vllm = {f.name: f for f in text_string_to_metric_families(recorded.read_text())}
    ours = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)
            if f.name.startswith("vllm:") and not f.name.endswith("_created")}
    assert len(ours) == 19  # 10 histograms, 3 gauges, 6 counters
    for name, family in ours.items():
        assert name in vllm and vllm[name].type == family.type, name
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            twins = [s for s in vllm[name].samples if s.name == sample.name]
            assert {frozenset(s.labels) for s in twins} == {frozenset(sample.labels)}, name
        if family.type == "histogram":
            def edges(fam):
                return [s.labels["le"] for s in fam.samples if s.name.endswith("_bucket")]
            assert edges(family) == edges(vllm[name]), name
