"""Loading, failing and draining: what the replica's health and requests say at each step."""

from __future__ import annotations

import shutil
import threading

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from runtime.engine.async_engine import EngineUnavailableError
from runtime.engine.server import ReplicaServer
from tests.runtime.engine.replica_http import (
    GREEDY,
    MAX_MODEL_LEN,
    make_client,
    parse_serve_args,
    sse_events,
    wait_ready,
)
from tests.waiting import wait_until


def test_health_is_503_while_loading_then_200(engine):
    release = threading.Event()

    def slow_load():
        release.wait(5)
        return engine

    test_client, _ = make_client(slow_load)
    with test_client:
        response = test_client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        busy = test_client.post("/v1/completions", json={"prompt": "x"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == 503
        release.set()
        wait_ready(test_client)


def test_failed_load_reports_the_error(tiny_llama_dir, tmp_path):
    from runtime.engine.server import build_backend

    # The tiny checkpoint without its weights, loaded the way `inferops serve` loads it.
    for path in tiny_llama_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, tmp_path)
    args, settings = parse_serve_args("--cpu-threads", "1", model=str(tmp_path))
    replica = ReplicaServer(build_backend(args), settings)
    with TestClient(replica.build_app(), raise_server_exceptions=False) as test_client:
        wait_until(lambda: replica.backend.state != "loading", "the load to end", interval=0.01)
        health = test_client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "no complete safetensors weights" in health.json()["error"]
        assert test_client.post("/v1/completions", json={"prompt": "x"}).status_code == 500


def nan_checkpoint(source, directory, token_id: int):
    """`source` with token `token_id`'s embedding made NaN: any prompt holding that token has
    NaN logits, as a checkpoint broken (or overflowing) for some inputs has."""
    from safetensors.torch import load_file, save_file

    for path in source.iterdir():
        shutil.copy(path, directory)
    weights = load_file(directory / "model.safetensors")
    weights["model.embed_tokens.weight"][token_id] = float("nan")
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_nan_logits_fail_that_request_only_and_say_what_to_try(make_engine, tiny_llama_dir,
                                                               tmp_path):
    nan_token = 300
    broken = make_engine(nan_checkpoint(tiny_llama_dir, tmp_path, nan_token),
                         max_model_len=MAX_MODEL_LEN)
    test_client, _ = make_client(lambda: broken)
    with test_client:
        wait_ready(test_client)
        prompt = [1, nan_token, 20]
        response = test_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert response.status_code == 500
        error = response.json()["error"]
        assert "NaN or infinite" in error["message"] and "--dtype float32" in error["message"]
        streamed = test_client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 3, "n": 2, "stream": True})
        events = sse_events(streamed.text)
        assert events[-1]["error"]["code"] == 500 and "NaN" in events[-1]["error"]["message"]
        assert test_client.get("/health").status_code == 200  # the replica itself is fine
        fine = test_client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2,
                                                         **GREEDY})
        assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 2
        samples = {(s.name, s.labels.get("finished_reason")): s.value
                   for f in text_string_to_metric_families(test_client.get("/metrics").text)
                   for s in f.samples}
    assert samples[("vllm:request_success_total", "error")] == 2
    assert samples[("vllm:request_success_total", "length")] == 1


def test_interrupted_requests_end_cleanly_and_are_aborted(engine):
    # What a drain that timed out does: streams get an error event and [DONE], the
    # engine drops the requests, and the metrics count them as aborted.
    test_client, replica = make_client(lambda: engine)
    with test_client:
        wait_ready(test_client)
        result = {}

        def stream():
            result["text"] = test_client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": MAX_MODEL_LEN - 2, "stream": True,
                **GREEDY}).text

        worker = threading.Thread(target=stream)
        worker.start()
        wait_until(engine.has_unfinished_requests, "the request to reach the engine", interval=0.01)
        interrupted = test_client.portal.call(
            replica.backend.interrupt_all, EngineUnavailableError("stopped"))
        worker.join(10)
        # The loop thread applies the abort between two steps.
        wait_until(lambda: not engine.has_unfinished_requests(), "the engine to abort it", interval=0.01)
        metrics = test_client.get("/metrics").text
    assert interrupted == 1
    events = sse_events(result["text"])
    assert events[-1]["error"]["code"] == 503
    assert "shutting down" in events[-1]["error"]["message"]
    assert len(events) < MAX_MODEL_LEN - 2
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 1.0' \
        in metrics
