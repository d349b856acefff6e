"""`inferops serve` end to end: a real process, the real engine on a tiny checkpoint, real HTTP,
and the official `openai` client.

One server is started per module and shared; the SIGTERM test, which ends it, runs last. The
encoder checkpoint gets its own server. Tests that change run-time state (faults) put it back
before they finish.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL = "tiny"
ADMIN = {"Authorization": "Bearer test-admin"}
MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 65536


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_seen: list[tuple[int, str]] = []
        command = [sys.executable, "-m", "project.cli", "serve", "--model", str(model_dir),
                   "--port", str(self.port), "--served-model-name", MODEL,
                   "--max-model-len", str(MAX_MODEL_LEN), "--admin-token", "test-admin",
                   "--max-body-bytes", str(MAX_BODY_BYTES), "--log-level", "warning",
                   "--cpu-threads", "1", *extra]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()}")
            health = httpx.get(f"{self.base_url}/health", timeout=1)
            self.health_seen.append((health.status_code, health.json()["status"]))
            return health.status_code == 200

        wait_until(ready, lambda: f"the server to be ready\n{self.log_path.read_text()}", timeout, 0.1,
                   ignore=(httpx.TransportError,))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    process = ServerProcess(tiny_llama_dir, tmp_path_factory.mktemp("serve") / "server.log")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                         timeout=30)


def scrape(server) -> dict[tuple[str, str | None], float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    return {(s.name, s.labels.get("finished_reason")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_health_says_loading_until_the_model_is_ready(server):
    # The port binds before torch is even imported, so the first answers are "loading".
    assert server.health_seen[0] == (503, "loading")
    assert server.health_seen[-1] == (200, "ready")


def test_models_lists_the_served_model(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
    assert raw["max_model_len"] == MAX_MODEL_LEN and raw["object"] == "model"


def test_chat_completion(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello world!"}], max_tokens=8,
        temperature=0)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert response.usage.prompt_tokens > 0
    assert 1 <= response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == (response.usage.prompt_tokens
                                           + response.usage.completion_tokens)


def test_completion_with_token_id_prompt(client):
    response = client.completions.create(model=MODEL, prompt=[1, 40, 41, 42], max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == 4 and response.usage.completion_tokens == 5


def test_streamed_completion_matches_the_non_streamed_one(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streamed_chat_opens_with_the_role_and_ends_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be terse."},
                               {"role": "user", "content": "Paged attention?"}],
        max_tokens=6, temperature=0.8, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_raw_stream_is_sse_ending_with_done(server):
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    frames = [f for f in body.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    first = json.loads(frames[0][len("data: "):])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_n_returns_independent_choices(client):
    response = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, n=2,
                                         temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 12


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(
            model=MODEL, prompt="Service level", max_tokens=12, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].text

    assert sample(123) == sample(123)
    assert sample(123) != sample(321)


def test_min_p_of_1_samples_only_the_most_likely_token(client):
    kwargs = dict(model=MODEL, prompt="Service level", max_tokens=12,
                  extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    sampled = client.completions.create(temperature=1.0, seed=5, **kwargs).choices[0].text
    assert sampled != greedy, "unlucky seed"
    kwargs["extra_body"]["min_p"] = 1.0
    assert client.completions.create(temperature=1.0, seed=5, **kwargs).choices[0].text == greedy


def test_stop_string_cuts_the_text(client):
    kwargs = dict(model=MODEL, prompt="Continuous batching", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), f"unlucky greedy text {full!r}"
    response = client.completions.create(stop=[stop], **kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[:full.index(stop)]
    assert choice.stop_reason == stop  # vLLM's field: which stop string it was


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Log me"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        # Greedy and no penalties: the chosen token is the most likely one.
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (
            entry.token, entry.logprob)
        assert entry.top_logprobs[1].logprob <= entry.logprob
        assert entry.bytes == list(entry.token.encode())
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    # The second request reads the first one's prompt from the prefix cache: the same tokens,
    # logprobs summed in another order.
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL, prompt="Log me", max_tokens=5,
                                         temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=True):
        assert top[token] == logprob == max(top.values()) and len(top) <= 3


def test_echo_scores_a_prompt_as_eval_harnesses_ask(client):
    # lm-evaluation-harness's loglikelihood requests: echo, logprobs, nothing generated.
    scored = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=0,
                                       echo=True, logprobs=1, temperature=0)
    choice = scored.choices[0]
    assert choice.text == "The quick brown fox" and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == scored.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:],
                                   logprobs.top_logprobs[1:], strict=True):
        assert logprob <= 0 and top[token] == logprob and len(top) <= 2
    # With a completion after it, streamed: the prompt's chunk first, then the tokens.
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox",
                                            max_tokens=3, echo=True, logprobs=1,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "The quick brown fox"
    assert chunks[0].choices[0].logprobs.token_logprobs == pytest.approx(
        logprobs.token_logprobs, abs=1e-4)
    streamed = [t for c in chunks[1:] if c.choices for t in c.choices[0].logprobs.tokens]
    assert len(streamed) == 3


def test_penalties_steer_greedy_decoding_away_from_repeats(client):
    kwargs = dict(model=MODEL, prompt="Again and again", max_tokens=16, temperature=0)
    plain = client.completions.create(logprobs=0, **kwargs).choices[0].logprobs.tokens
    assert len(set(plain)) < len(plain), f"no repeats to steer away from: {plain}"
    penalized = client.completions.create(
        logprobs=0, frequency_penalty=2.0, presence_penalty=2.0,
        extra_body={"repetition_penalty": 2.0}, **kwargs).choices[0].logprobs.tokens
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))
    forced = client.completions.create(logprobs=0, logit_bias={"42": 100},
                                       **kwargs).choices[0].logprobs.tokens
    assert len(set(forced)) == 1 and forced != plain


def test_metrics_count_the_tokens_sent_and_received(server, client):
    before = scrape(server)
    prompt = [1, 50, 51, 52, 53, 54, 55]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                              extra_body={"ignore_eos": True})
    after = scrape(server)

    def delta(name, reason=None):
        return after.get((name, reason), 0) - before.get((name, reason), 0)

    assert delta("vllm:prompt_tokens_total") == len(prompt)
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:request_success_total", "length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_queue_time_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:request_time_per_output_token_seconds_count") == 1
    # Every prompt token is looked up in the prefix cache (on by default); 7 tokens fill no
    # 16-token block, so none can hit.
    assert delta("vllm:prefix_cache_queries_total") == len(prompt)
    assert delta("vllm:prefix_cache_hits_total") == 0
    assert after[("vllm:num_requests_running", None)] == 0
    assert after[("vllm:kv_cache_usage_perc", None)] == 0  # nothing running holds a block (cached ones are free)
    # Restarts are told apart from growth by the process start time, as on vLLM.
    assert after[("process_start_time_seconds", None)] == before[("process_start_time_seconds", None)] > 0


@pytest.mark.parametrize("payload, status, param", [
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 9}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": [5, 10**6]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
])
def test_bad_completion_requests(server, payload, status, param):
    response = httpx.post(f"{server.base_url}/v1/completions", json=payload)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status
    assert "Traceback" not in response.text


def test_context_length_error_has_both_lengths(server):
    response = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": MODEL, "prompt": [5] * 500, "max_tokens": 100})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "500 in the prompt" in message and "100 in the completion" in message
    assert str(MAX_MODEL_LEN) in message


def test_malformed_json_and_oversized_body(server):
    url = f"{server.base_url}/v1/chat/completions"
    malformed = httpx.post(url, content=b'{"model": ', headers={"content-type":
                                                                 "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "body"
    big = httpx.post(url, json={"model": MODEL, "messages": [
        {"role": "user", "content": "x" * MAX_BODY_BYTES}]})
    assert big.status_code == 413 and big.json()["error"]["code"] == 413


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                 "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_client_disconnect_aborts_the_request(server):
    before = scrape(server)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8,
            "ignore_eos": True, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert scrape(server)[("vllm:num_requests_running", None)] == 1
    # Leaving the block closed the connection mid-stream.
    wait_until(lambda: scrape(server)[("vllm:num_requests_running", None)] == 0,
               "the aborted request to stop running", 3)
    after = scrape(server)
    assert after[("vllm:request_success_total", "abort")] == \
        before[("vllm:request_success_total", "abort")] + 1
    assert after[("vllm:generation_tokens_total", None)] - \
        before[("vllm:generation_tokens_total", None)] < MAX_MODEL_LEN - 8


def test_disconnect_during_a_non_streamed_request_aborts_it(server):
    before = scrape(server)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8,
                       "n": 4, "ignore_eos": True}).encode()
    # The client hangs up once the engine is generating, not after a fixed wait: on a fast
    # CPU the whole request fits in a fraction of a second.
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: replica\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(body), body))
        wait_until(lambda: scrape(server)[("vllm:num_requests_running", None)] > 0, "the request to start", 5,
                   interval=0)
    wait_until(lambda: scrape(server)[("vllm:request_success_total", "abort")] >
               before[("vllm:request_success_total", "abort")], "the abandoned request to be aborted", 3)
    after = scrape(server)
    assert after[("vllm:num_requests_running", None)] == 0
    assert after[("vllm:generation_tokens_total", None)] - \
        before[("vllm:generation_tokens_total", None)] < 4 * (MAX_MODEL_LEN - 8)


def test_concurrent_streams_are_batched_and_all_complete(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str]:
        text = ""
        async with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": f"Request {i}", "max_tokens": 20 + i,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text = line
        return i, json.loads(text[len("data: "):])["usage"]["completion_tokens"]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    assert sorted(asyncio.run(run_all())) == [(i, 20 + i) for i in range(6)]


def set_faults(server, **faults) -> httpx.Response:
    return httpx.post(f"{server.base_url}/admin/faults", json=faults, headers=ADMIN)


def first_token_seconds(client) -> float:
    started = time.monotonic()
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, stream=True)
    next(iter(stream))
    elapsed = time.monotonic() - started
    stream.close()
    return elapsed


def test_fault_injection_changes_ttft_and_error_rate(server, client):
    assert httpx.get(f"{server.base_url}/admin/faults").status_code == 401
    assert httpx.post(f"{server.base_url}/admin/faults", json={"fault_ttft_ms": 1},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    baseline = first_token_seconds(client)
    try:
        assert set_faults(server, fault_ttft_ms=600).json()["fault_ttft_ms"] == 600
        delayed = first_token_seconds(client)
        assert delayed >= 0.6 and delayed > baseline
        set_faults(server, fault_ttft_ms=0, fault_error_rate=1.0)
        with pytest.raises(openai.InternalServerError, match="Injected fault"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        set_faults(server, fault_ttft_ms=0, fault_tpot_ms=0, fault_error_rate=0)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_embeddings_from_an_encoder_checkpoint(tmp_path):
    from runtime.engine.encoder import EmbeddingModel, find_packaged_minilm

    model_dir = find_packaged_minilm()
    process = ServerProcess(model_dir, tmp_path / "server.log")
    try:
        process.wait_ready()
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="x", max_retries=0)
        texts = ["The cat sits on the mat.", "A cat is sitting on a mat.", "GPU prices rose."]
        # The openai client asks for base64 and decodes it; the float form must agree.
        response = client.embeddings.create(model=MODEL, input=texts)
        as_floats = httpx.post(f"{process.base_url}/v1/embeddings", json={
            "model": MODEL, "input": texts[0], "encoding_format": "float"}).json()
        completions = httpx.post(f"{process.base_url}/v1/completions",
                                 json={"model": MODEL, "prompt": "x"})
    finally:
        process.stop()
    expected, counts = EmbeddingModel.load(model_dir).embed(texts)
    vectors = [item.embedding for item in response.data]
    assert [item.index for item in response.data] == [0, 1, 2]
    assert response.usage.prompt_tokens == sum(counts)
    for got, want in zip(vectors, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(as_floats["data"][0]["embedding"], expected[0],
                                          strict=True)) < 1e-6

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2])
    assert completions.status_code == 400


# Keep this test last in the module: it ends the shared server (which saves a start-up).
def test_sigterm_drains_in_flight_requests_then_exits_zero(server):
    # Slow tokens keep the request in flight long enough to send SIGTERM.
    assert set_faults(server, fault_tpot_ms=40).status_code == 200
    result: dict = {}
    streaming = threading.Event()

    def stream_request() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}) as response:
            frames = []
            for line in response.iter_lines():
                streaming.set()
                if line:
                    frames.append(line)
            result["frames"] = frames

    worker = threading.Thread(target=stream_request)
    worker.start()
    assert streaming.wait(30)  # in flight now: 40 tokens at 40 ms take 1.6 s more
    server.proc.send_signal(signal.SIGTERM)

    def draining() -> httpx.Response | None:
        health = httpx.get(f"{server.base_url}/health")
        return health if health.status_code != 200 else None

    health = wait_until(draining, "SIGTERM to start draining", 1, 0.02)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = httpx.post(f"{server.base_url}/v1/completions",
                         json={"model": MODEL, "prompt": "x"})
    assert refused.status_code == 503
    assert worker.is_alive(), "the request should still be streaming while draining"
    worker.join(30)
    assert server.proc.wait(30) == 0
    frames = result["frames"]
    assert frames[-1] == "data: [DONE]"
    usage, last = (json.loads(f[len("data: "):]) for f in (frames[-2], frames[-3]))
    assert usage["usage"]["completion_tokens"] == 40
    assert last["choices"][0]["finish_reason"] == "length"
