"""`inferops bench` against a small in-process OpenAI-compatible responder with fixed timing."""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from runtime.loadgen import (
    BenchConfig,
    BenchConfigError,
    LengthRange,
    PromptPlanner,
    RequestClass,
    RequestResult,
    arrival_gaps,
    format_report,
    run_benchmark,
    summarize,
)
from tests.conftest import free_port
from tests.waiting import wait_until

TTFT_S = 0.05
CHUNK_GAP_S = 0.01


class Responder:
    """Streams `max_tokens` one-word chunks: the first after TTFT_S, then one every CHUNK_GAP_S.
    Chat streams open with an immediate role chunk that carries no text, like vLLM's."""

    def __init__(self):
        self.reset()

    def reset(self, *, fail_every: int = 0, send_usage: bool = True, refuse_key: str | None = None,
              refuse_code: str = "degraded"):
        self.fail_every = fail_every
        self.send_usage = send_usage
        self.refuse_key = refuse_key  # requests with this bearer key get a 503 with code refuse_code
        self.refuse_code = refuse_code
        self.payloads: list[dict] = []
        self.keys: list[str] = []
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def handle(self, request: Request):
        payload = await request.json()
        self.payloads.append(payload)
        self.arrivals.append(time.perf_counter())
        self.keys.append(request.headers["authorization"].removeprefix("Bearer "))
        if self.keys[-1] == self.refuse_key:
            body = {"error": {"message": "shed", "type": "ServiceUnavailableError", "code": self.refuse_code}}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
        if self.fail_every and len(self.payloads) % self.fail_every == 0:
            body = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
            return JSONResponse(body, status_code=500)
        return StreamingResponse(self.events(payload), media_type="text/event-stream")

    async def events(self, payload: dict):
        chat = "messages" in payload
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        max_tokens = payload["max_completion_tokens"] if chat else payload["max_tokens"]
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if chat:
                yield sse(
                    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                )
            await asyncio.sleep(TTFT_S)
            for index in range(max_tokens):
                if index:
                    await asyncio.sleep(CHUNK_GAP_S)
                text = f" w{index}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
                yield sse({"choices": [choice]})
            if self.send_usage and payload.get("stream_options", {}).get("include_usage"):
                prompt_tokens = len(prompt.split())
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
                yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


@pytest.fixture(scope="session")
def responder_server():
    responder = Responder()
    routes = [
        Route("/v1/completions", responder.handle, methods=["POST"]),
        Route("/v1/chat/completions", responder.handle, methods=["POST"]),
    ]
    # Bind here and hand the socket over, so no other process can take the port in between.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(Starlette(routes=routes), log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the responder to start", 10, 0.02)
    yield responder, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def responder(responder_server):
    responder, _ = responder_server
    responder.reset()
    return responder


@pytest.fixture
def make_config(responder_server):
    _, base_url = responder_server

    def build(**overrides) -> BenchConfig:
        settings = dict(
            base_url=base_url,
            model="fake",
            num_prompts=6,
            input_len=LengthRange(10, 10),
            output_len=LengthRange(5, 5),
            show_progress=False,
        )
        settings.update(overrides)
        return BenchConfig(**settings)

    return build


def test_counts_and_latencies_follow_the_stream(responder, make_config):
    metrics = run_benchmark(make_config(num_prompts=6))
    assert metrics["completed"] == 6, metrics["error_messages"]
    assert metrics["total_input_tokens"] == 6 * 10
    assert metrics["total_output_tokens"] == 6 * 5
    assert metrics["errors"] == {}
    # The responder sleeps at least these long; scheduling can only add.
    assert metrics["p50_ttft_ms"] >= TTFT_S * 1000
    # Not so for one gap between chunks: a chunk that reaches the client late (a busy or
    # CPU-starved machine) makes the next gap shorter than the responder's sleep (a p50 of
    # 9.0 ms was seen in CI). Over all gaps only the first chunk's delay is taken off.
    assert metrics["mean_itl_ms"] >= CHUNK_GAP_S * 1000 * 0.5
    assert metrics["mean_e2el_ms"] >= (TTFT_S + 4 * CHUNK_GAP_S) * 1000
    # TPOT is (E2EL - TTFT) / (tokens - 1) for each request.
    expected_tpot = np.mean(
        [
            (e2el - ttft) / 4 * 1000
            for e2el, ttft in zip(metrics["e2els"], metrics["ttfts"], strict=True)
        ]
    )
    assert metrics["mean_tpot_ms"] == pytest.approx(expected_tpot)
    assert metrics["request_throughput"] == pytest.approx(6 / metrics["duration"])
    assert metrics["output_throughput"] == pytest.approx(30 / metrics["duration"])
    payload = responder.payloads[0]
    assert payload["ignore_eos"] is True and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 5 and len(payload["prompt"].split()) == 10
    assert payload["temperature"] == 0.0 and "top_p" not in payload and "top_k" not in payload


def test_sampling_options_are_sent_with_every_request(responder, make_config):
    run_benchmark(make_config(num_prompts=2, temperature=0.7, top_p=0.9, top_k=40,
                              presence_penalty=-0.5, repetition_penalty=1.05))
    for payload in responder.payloads:
        assert (payload["temperature"], payload["top_p"], payload["top_k"]) == (0.7, 0.9, 40)
        assert (payload["presence_penalty"], payload["repetition_penalty"]) == (-0.5, 1.05)
        assert "frequency_penalty" not in payload


def test_chat_role_chunk_without_text_does_not_count_as_first_token(responder, make_config):
    metrics = run_benchmark(make_config(endpoint="chat", num_prompts=3))
    assert metrics["completed"] == 3
    assert metrics["total_output_tokens"] == 15
    # The role chunk arrives at once; TTFT waits for the first text.
    assert min(metrics["ttfts"]) >= TTFT_S
    payload = responder.payloads[0]
    assert payload["messages"][0]["role"] == "user"
    assert payload["max_completion_tokens"] == 5


def test_output_tokens_fall_back_to_chunk_count_without_usage(responder, make_config):
    responder.reset(send_usage=False)
    metrics = run_benchmark(make_config(num_prompts=3, output_len=LengthRange(7, 7)))
    assert metrics["output_lens"] == [7, 7, 7]
    # Without usage, input tokens are the planned lengths (words here).
    assert metrics["input_lens"] == [10, 10, 10]


def test_server_errors_are_counted_by_kind(responder, make_config):
    responder.reset(fail_every=3)
    metrics = run_benchmark(make_config(num_prompts=9, max_concurrency=1))
    assert metrics["completed"] == 6 and metrics["failed"] == 3
    assert metrics["errors"] == {"http_500": 3}
    assert metrics["error_messages"] == {"http_500": "boom"}
    assert metrics["total_output_tokens"] == 6 * 5


def test_unreachable_server_counts_connection_errors(make_config):
    config = make_config(base_url=f"http://127.0.0.1:{free_port()}", num_prompts=2)
    metrics = run_benchmark(config)
    assert metrics["completed"] == 0 and metrics["errors"] == {"connection": 2}


def test_goodput_counts_requests_meeting_every_slo(responder, make_config):
    generous = run_benchmark(make_config(goodput_slos_ms={"ttft": 5000, "e2el": 10000}))
    assert generous["good_requests"] == 6
    assert generous["request_goodput"] == pytest.approx(generous["request_throughput"])
    # Every TTFT is at least 50 ms, so a 1 ms TTFT SLO is missed by all, whatever else passes.
    strict = run_benchmark(make_config(goodput_slos_ms={"ttft": 1, "e2el": 10000}))
    assert strict["good_requests"] == 0 and strict["request_goodput"] == 0.0
    assert run_benchmark(make_config())["request_goodput"] is None


def test_request_classes_send_their_keys_in_exact_shares_and_are_summarized_apart(
    responder, make_config
):
    classes = [RequestClass("high", "key-high", 0.2), RequestClass("low", "key-low", 0.8)]
    responder.reset(refuse_key="key-low")
    config = make_config(num_prompts=10, request_rate=200.0, request_classes=classes,
                         goodput_slos_ms={"ttft": 5000})
    metrics = run_benchmark(config)
    assert sorted(responder.keys) == ["key-high"] * 2 + ["key-low"] * 8
    assert sorted(metrics["request_classes"]) == ["high"] * 2 + ["low"] * 8
    high, low = metrics["classes"]["high"], metrics["classes"]["low"]
    assert (high["completed"], high["failed"], high["good_requests"]) == (2, 0, 2)
    assert (low["completed"], low["failed"], low["errors"]) == (0, 8, {"http_503": 8})
    assert high["request_goodput"] == pytest.approx(metrics["request_goodput"])
    for name, kind, code in zip(metrics["request_classes"], metrics["error_kinds"],
                                metrics["error_codes"], strict=True):
        assert (kind, code) == (("", "") if name == "high" else ("http_503", "degraded"))
    # Send times follow the arrival schedule, in the order the requests were planned.
    assert metrics["sent_at"] == sorted(metrics["sent_at"]) and metrics["sent_at"][0] < 0.05
    assert time.time() - 60 < metrics["started_at"] < time.time()
    assert metrics["config"]["request_classes"][0] == {"name": "high", "share": 0.2}
    assert "key-high" not in json.dumps(metrics["config"])
    assert "classes" not in run_benchmark(make_config(num_prompts=2))


def test_late_refusals_are_counted_apart_from_failures_and_are_never_good(responder, make_config):
    classes = [RequestClass("on-time", "key-ok", 0.4), RequestClass("late", "key-late", 0.6)]
    responder.reset(refuse_key="key-late", refuse_code="slo_late", fail_every=5)
    metrics = run_benchmark(make_config(num_prompts=10, request_rate=200.0, request_classes=classes,
                                        goodput_slos_ms={"ttft": 5000}))
    # Every fifth request (by arrival) answers 500 unless its key is refused first.
    failed_500 = sum(1 for index, key in enumerate(responder.keys, 1) if key == "key-ok" and index % 5 == 0)
    assert metrics["rejected"] == 6
    assert metrics["failed"] == failed_500 and metrics["errors"] == ({"http_500": failed_500} if failed_500 else {})
    assert metrics["completed"] == 4 - failed_500 == metrics["good_requests"]
    assert metrics["completed"] + metrics["failed"] + metrics["rejected"] == 10
    late = metrics["classes"]["late"]
    assert (late["completed"], late["failed"], late["rejected"], late["request_goodput"]) == (0, 0, 6, 0.0)
    assert "Rejected as late (503 slo_late):" in format_report(metrics)
    # Any other 503 (a gateway's shed, say) stays a failure.
    responder.reset(refuse_key="key-late", refuse_code="degraded")
    other = run_benchmark(make_config(num_prompts=10, request_classes=classes))
    assert (other["rejected"], other["failed"], other["errors"]) == (0, 6, {"http_503": 6})
    assert "Rejected as late" not in format_report(other)


def test_a_late_refusal_inside_an_open_stream_is_a_rejection_too():
    results = [RequestResult(True, output_tokens=3, ttft_s=0.1, e2el_s=0.3),
               RequestResult(False, error_kind="stream_error", error_code="slo_late"),
               RequestResult(False, error_kind="http_503", error_code="slo_late"),
               RequestResult(False, error_kind="stream_error", error_code="500")]
    metrics = summarize(results, duration_s=1.0, slos_ms={"ttft": 1000})
    assert (metrics["completed"], metrics["failed"], metrics["rejected"]) == (1, 1, 2)
    assert metrics["errors"] == {"stream_error": 1} and metrics["good_requests"] == 1


@pytest.mark.parametrize("shares, counts", [((1, 1, 1), (4, 3, 3)), ((0.2, 0.8), (2, 8)), ((5,), (10,))])
def test_request_class_counts_are_exact_shares_and_leave_the_prompts_alone(make_config, shares, counts):
    classes = [RequestClass(f"c{index}", f"k{index}", share) for index, share in enumerate(shares)]
    planned = PromptPlanner(make_config(num_prompts=10, request_classes=classes)).plan()
    names = [request.request_class for request in planned]
    assert tuple(names.count(c.name) for c in classes) == counts
    # The classes do not change what a seed sends, only with which key.
    plain = PromptPlanner(make_config(num_prompts=10)).plan()
    assert [r.prompt for r in planned] == [r.prompt for r in plain]


def test_max_concurrency_caps_requests_in_flight(responder, make_config):
    metrics = run_benchmark(make_config(num_prompts=6, max_concurrency=2))
    assert metrics["completed"] == 6
    assert responder.most_in_flight == 2


def test_request_rate_paces_the_arrivals(responder, make_config):
    config = make_config(num_prompts=8, request_rate=20.0, seed=5)
    metrics = run_benchmark(config)
    gaps = arrival_gaps(8, 20.0, 1.0, random.Random(config.seed + 1))
    assert len(responder.payloads) == 8 and metrics["completed"] == 8
    # The run lasts at least until the last scheduled send plus that request's own streaming.
    assert metrics["duration"] >= sum(gaps) + TTFT_S
    # Arrivals keep the schedule's spacing; the slack covers connection set-up jitter.
    arrivals = np.array(responder.arrivals) - responder.arrivals[0]
    assert np.all(arrivals >= np.cumsum(gaps) - 0.03)


def test_arrival_gaps_have_the_asked_rate_and_burstiness():
    poisson = np.array(arrival_gaps(4001, 10.0, 1.0, random.Random(1))[1:])
    bursty = np.array(arrival_gaps(4001, 10.0, 0.25, random.Random(1))[1:])
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.mean() == pytest.approx(0.1, rel=0.1)
    # Gamma intervals: squared coefficient of variation is 1 / shape.
    assert (poisson.std() / poisson.mean()) ** 2 == pytest.approx(1.0, rel=0.1)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.15)
    assert arrival_gaps(3, math.inf, 1.0, random.Random(1)) == [0.0, 0.0, 0.0]


def test_percentiles_tpot_and_goodput_match_hand_computed_values():
    results = [
        RequestResult(
            True, prompt_len=10, output_tokens=11, ttft_s=t, e2el_s=t + 1.0, itls_s=[0.1] * 10
        )
        for t in (0.1, 0.2, 0.3, 0.4, 0.5)
    ]
    results.append(RequestResult(False, error_kind="http_500"))
    # One output token: no TPOT sample, cannot miss a TPOT SLO.
    results.append(RequestResult(True, prompt_len=4, output_tokens=1, ttft_s=0.05, e2el_s=0.05))
    metrics = summarize(results, duration_s=2.0, slos_ms={"ttft": 250, "tpot": 100})
    assert metrics["completed"] == 6 and metrics["failed"] == 1 and metrics["rejected"] == 0
    assert metrics["errors"] == {"http_500": 1}
    assert metrics["total_input_tokens"] == 54 and metrics["total_output_tokens"] == 56
    assert metrics["request_throughput"] == 3.0
    assert metrics["output_throughput"] == 28.0
    assert metrics["total_token_throughput"] == 55.0
    # TTFTs (ms): 50, 100, 200, 300, 400, 500 -> linear-interpolated percentiles.
    assert metrics["median_ttft_ms"] == pytest.approx(250.0)
    assert metrics["p50_ttft_ms"] == pytest.approx(250.0)
    assert metrics["p90_ttft_ms"] == pytest.approx(450.0)
    assert metrics["p95_ttft_ms"] == pytest.approx(475.0)
    assert metrics["p99_ttft_ms"] == pytest.approx(495.0)
    assert metrics["mean_ttft_ms"] == pytest.approx(258.333333)
    # TPOT = (E2EL - TTFT) / (11 - 1) = 100 ms for the five long answers.
    assert metrics["mean_tpot_ms"] == pytest.approx(100.0)
    assert metrics["p99_tpot_ms"] == pytest.approx(100.0)
    assert metrics["mean_itl_ms"] == pytest.approx(100.0)
    # Good: TTFT 100 and 200 (TPOT 100 <= 100) and the one-token answer (TTFT 50).
    assert metrics["good_requests"] == 3
    assert metrics["request_goodput"] == 1.5


def test_exact_token_lengths_and_shared_prefix(responder, make_config, tmp_path):
    from tokenizers import Tokenizer

    from runtime.engine.demo_model import build_demo_tokenizer

    build_demo_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = make_config(
        num_prompts=10,
        input_len=LengthRange(20, 40),
        shared_prefix_len=16,
        shared_prefix_ratio=0.5,
        tokenizer_dir=str(tmp_path),
    )
    responder.reset(send_usage=False)
    metrics = run_benchmark(config)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompts = [payload["prompt"] for payload in responder.payloads]
    token_lists = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    planned = metrics["input_lens"]
    assert sorted(len(ids) for ids in token_lists) == sorted(planned)
    assert all(36 <= length <= 56 for length in planned)
    prefixes = [tuple(ids[:16]) for ids in token_lists]
    most_common_count = max(prefixes.count(prefix) for prefix in prefixes)
    assert most_common_count == 5 and len(set(prefixes)) == 6


def test_same_seed_gives_the_same_prompts(responder, make_config):
    run_benchmark(make_config(num_prompts=3, seed=9, input_len=LengthRange(5, 50)))
    first = sorted(payload["prompt"] for payload in responder.payloads)
    responder.reset()
    run_benchmark(make_config(num_prompts=3, seed=9, input_len=LengthRange(5, 50)))
    assert sorted(payload["prompt"] for payload in responder.payloads) == first


def test_cli_prints_the_table_and_writes_the_result_json(responder_server, tmp_path, capsys):
    from project.cli import main

    _, base_url = responder_server
    result_path = tmp_path / "result.json"
    argv = [
        "bench",
        "--base-url",
        base_url,
        "--model",
        "fake",
        "--num-prompts",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "3-6",
        "--request-rate",
        "inf",
        "--goodput",
        "ttft:5000",
        "tpot:1000",
        "--result-json",
        str(result_path),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    for label in (
        "Successful requests:",
        "Request goodput (req/s):",
        "P99 TTFT (ms):",
        "P90 TPOT (ms):",
        "P95 ITL (ms):",
        "Median E2EL (ms):",
    ):
        assert label in table
    saved = json.loads(result_path.read_text())
    for key in (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "errors",
        "p99_ttft_ms",
        "p50_tpot_ms",
        "p95_itl_ms",
        "mean_e2el_ms",
        "config",
    ):
        assert key in saved
    assert saved["completed"] == 4
    assert saved["config"]["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 1000.0}
    assert "api_key" not in saved["config"]
    assert all(3 <= length <= 6 for length in saved["output_lens"])


@pytest.mark.parametrize(
    "overrides, option",
    [
        ({"endpoint": "embeddings"}, "endpoint"),
        ({"request_rate": 0}, "request_rate"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"shared_prefix_ratio": 1.5}, "shared_prefix_ratio"),
        ({"goodput_slos_ms": {"latency": 5}}, "goodput"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"request_classes": [RequestClass("a", "k", 1), RequestClass("a", "k", 1)]}, "request_classes"),
        ({"request_classes": [RequestClass("a", "k", 0)]}, "request_classes"),
    ],
)
def test_bad_options_name_the_option(make_config, overrides, option):
    with pytest.raises(BenchConfigError, match=option):
        run_benchmark(make_config(**overrides))


@pytest.mark.parametrize("text", ["0", "9-3", "abc", "5-"])
def test_bad_lengths_are_refused(text):
    with pytest.raises(BenchConfigError, match="input-len"):
        LengthRange.parse(text, "input-len")
