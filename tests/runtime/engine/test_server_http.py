"""HTTP-layer tests of the replica server, in process, against the real engine.

Every generation here runs through `LLMEngine` on the tiny random Llama (`make_engine` in
conftest.py) and every embedding through the packaged MiniLM. Random weights write no text
worth pinning, so a test checks what the engine and its tokenizer say instead: token counts,
each token's text, greedy logprobs, streamed text equal to the non-streamed text.

A scripted engine stays only for failures the real one cannot be made to produce: its loop
thread dying in the middle of a step (a CUDA error, running out of memory), an encoder crashing
the same way, and a logprob of -inf (the real one reports the log-softmax of finite logits).
`test_the_scripted_engine_answers_in_the_real_engines_shapes` proves that what the scripted one
sends has the same JSON keys and types, and the same SSE framing, as the real one.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from runtime.engine.async_engine import AsyncEmbedder, AsyncEngine, EngineUnavailableError
from runtime.engine.config import GenerationDefaults
from runtime.engine.sampling import TokenLogprob
from runtime.engine.server import FaultSettings, ReplicaServer, ServerSettings
from tests.waiting import wait_until

MODEL = "tiny"
MAX_MODEL_LEN = 64
GREEDY = {"temperature": 0, "ignore_eos": True}  # the same tokens every time, all of them


# ---------------------------------------------------------------------------------------------
# The real engine and how tests reach it


def make_client(load, **settings) -> tuple[TestClient, ReplicaServer]:
    replica = ReplicaServer(AsyncEngine(load),
                            ServerSettings(served_model_name=MODEL, model_root="/models/tiny",
                                           **settings))
    return TestClient(replica.build_app(), raise_server_exceptions=False), replica


def wait_ready(client: TestClient) -> None:
    wait_until(lambda: client.get("/health").status_code == 200, "the engine to become ready", interval=0.01)


@pytest.fixture
def engine(make_engine):
    """The real LLMEngine on the tiny Llama; the server drives it from its own thread."""
    return make_engine(max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture
def seen_params(engine) -> list:
    """The SamplingParams of each request the engine took, in order (its own add_request runs)."""
    seen = []
    add_request = engine.add_request

    def recording(request_id, prompt_token_ids, params, priority=0):
        add_request(request_id, prompt_token_ids, params, priority=priority)
        seen.append(params)

    engine.add_request = recording
    return seen


@pytest.fixture
def client(engine):
    test_client, _ = make_client(lambda: engine, admin_token="s3cret", max_body_bytes=2048)
    with test_client:
        wait_ready(test_client)
        yield test_client


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n")
    frames = [f for f in text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def check_legacy_logprobs(logprobs: dict, num_tokens: int, k: int) -> None:
    """Completions' logprobs as vLLM writes them, for a greedy choice: the sampled token is
    the most likely one, so it heads its own alternatives."""
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    assert len(tokens) == len(values) == len(logprobs["top_logprobs"]) == num_tokens
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for token, value, top in zip(tokens, values, logprobs["top_logprobs"], strict=True):
        assert isinstance(value, float) and value <= 0
        assert 1 <= len(top) <= max(k, 1) and top[token] == value == max(top.values())


# ---------------------------------------------------------------------------------------------
# Responses


def test_completion_shape_and_usage(client, tokenizer):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 3, **GREEDY})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert isinstance(choice.pop("text"), str)
    assert choice == {"index": 0, "logprobs": None, "finish_reason": "length",
                      "stop_reason": None}
    prompt_tokens = len(tokenizer.encode("hi"))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                             "total_tokens": prompt_tokens + 3}
    assert response.headers["x-request-id"] == body["id"]


def test_generation_config_fills_in_what_a_request_leaves_out(engine, seen_params):
    # Qwen2.5's file, as shipped.
    defaults = GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05,
                                  repetition_penalty=1.05)
    test_client, _ = make_client(lambda: engine, generation_defaults=defaults)
    with test_client:
        wait_ready(test_client)
        test_client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        test_client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "b"}], "max_tokens": 1,
            "temperature": 0, "top_k": -1, "repetition_penalty": 1.0})
    first, second = seen_params
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty) == (
        0.7, 0.8, 20, 1.05)
    assert (first.min_p, second.min_p) == (0.05, 0.05)
    assert (second.temperature, second.top_p, second.top_k, second.repetition_penalty) == (
        0.0, 0.8, 0, 1.0)


def test_generation_config_is_read_and_checked(tmp_path):
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults()  # no file: OpenAI's
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05,
                                "presence_penalty": 0.5}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05,
        ignored=("presence_penalty",))
    path.write_text(json.dumps({"temperature": 0.6, "top_k": -1}))
    assert GenerationDefaults.from_dir(tmp_path) == GenerationDefaults(temperature=0.6)
    for bad, key in (({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature"),
                     ({"top_k": 2.5}, "top_k"), ({"top_k": float("inf")}, "top_k"),
                     ({"repetition_penalty": 0}, "repetition_penalty"),
                     ({"min_p": 1.5}, "min_p")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=key):
            GenerationDefaults.from_dir(tmp_path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationDefaults.from_dir(tmp_path)


def test_serve_refuses_an_unusable_generation_config_and_says_how_to_go_on(tmp_path, caplog):
    from project.cli import main

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "top_p" in caplog.text and "--no-generation-config" in caplog.text


def test_prompt_as_token_ids_and_n(client):
    body = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2,
                                                "n": 2, "ignore_eos": True}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_chat_stream_with_usage(client, tokenizer):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "yo"}],
               "max_tokens": 4, **GREEDY}
    whole = client.post("/v1/chat/completions", json=request).json()
    response = client.post("/v1/chat/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert "".join(contents) == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    template = tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True)
    prompt_len = len(tokenizer.encode(template, add_special_tokens=False))
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == whole["usage"] == {
        "prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4}


def test_completion_stream_without_usage(client):
    request = {"prompt": "x", "max_tokens": 3, **GREEDY}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    events = sse_events(client.post("/v1/completions", json={**request, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events)


def test_chat_defaults_max_tokens_to_remaining_context(client, tokenizer):
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    body = client.post("/v1/chat/completions", json={"messages": messages,
                                                     "ignore_eos": True}).json()
    # The template knows "system"; "developer" is OpenAI's newer name for it.
    template = tokenizer.apply_chat_template([{"role": "system", "content": "d"}, messages[1]],
                                             add_generation_prompt=True)
    prompt_len = len(tokenizer.encode(template, add_special_tokens=False))
    assert body["usage"]["prompt_tokens"] == prompt_len
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - prompt_len
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("payload, param, fragment", [
    ({"prompt": 5}, "prompt", "string or an array of token ids"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "must be an integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "temperature": True}, "temperature", "must be a number"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "<= 1.0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "> 0"),
    ({"prompt": "x", "seed": 2**64}, "seed", "<="),
    ({"prompt": "x", "stop": [1]}, "stop", "`stop`"),
    ({"prompt": "x", "n": 99}, "n", "<= 16"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "must be an integer"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"prompt": "x", "echo": 1}, "echo", "must be a boolean"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens", ">= 0"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", ">= -2.0"),
    ({"prompt": "x", "frequency_penalty": "high"}, "frequency_penalty", "must be a number"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"prompt": "x", "min_p": 2}, "min_p", "<= 1.0"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias", "[-100, 100]"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias", "must be an object"),
    ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, "min_tokens", "<= 3"),
    ({"prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ({"prompt": "x", "bogus": 1}, "bogus", "Unrecognized"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": ["a", "b"]}, "prompt", "Batched prompts"),
    ({}, "prompt", "required"),
    ([1, 2], "body", "JSON object"),
])
def test_completion_bad_input_names_the_field(client, payload, param, fragment):
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]
    assert error["type"] == "BadRequestError" and error["code"] == 400


@pytest.mark.parametrize("payload, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
      "max_completion_tokens": 2}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
])
def test_chat_bad_input(client, payload, param):
    response = client.post("/v1/chat/completions", json=payload)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_harmless_parameters_are_accepted(client):
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 1, "user": "alice", "logprobs": False, "top_logprobs": 0,
        "presence_penalty": 0, "top_k": -1, "seed": 3, "priority": -2})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None


def test_penalties_bias_and_min_tokens_reach_the_engine(client, seen_params):
    response = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "presence_penalty": -2, "frequency_penalty": 1.5,
        "repetition_penalty": 1.2, "logit_bias": {"7": -100, "12": 2.5}, "min_tokens": 2})
    assert response.status_code == 200, response.text
    [params] = seen_params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        -2.0, 1.5, 1.2)
    assert params.logit_bias == {7: -100.0, 12: 2.5} and params.min_tokens == 2
    assert response.json()["usage"]["completion_tokens"] == 2  # min_tokens held EOS back


def test_completion_logprobs_in_openais_legacy_shape(client):
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2,
                                                "logprobs": 2, **GREEDY}).json()
    for choice in body["choices"]:
        check_legacy_logprobs(choice["logprobs"], num_tokens=3, k=2)
    # logprobs=0: the sampled token only.
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                "logprobs": 0, **GREEDY}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{token: value} for token, value in zip(
        logprobs["tokens"], logprobs["token_logprobs"], strict=True)]


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client, seen_params, tokenizer):
    body = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2,
                                                "echo": True, **GREEDY}).json()
    text = body["choices"][0]["text"]
    assert text.startswith("xy") and body["choices"][0]["logprobs"] is None
    assert seen_params[-1].prompt_logprobs is None  # no logprobs: none computed
    body = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 1, "echo": True,
                                                "logprobs": 1, **GREEDY}).json()
    logprobs = body["choices"][0]["logprobs"]
    prompt_ids = tokenizer.encode("xy")
    num_prompt = len(prompt_ids)
    # The prompt's tokens as each reads alone (BOS included); the first has no logprob.
    assert logprobs["tokens"][:num_prompt] == [tokenizer.token_text(t) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert len(logprobs["tokens"]) == num_prompt + 1
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    # The generated token is the greedy one: the head of its own alternatives.
    last_top = logprobs["top_logprobs"][-1]
    assert last_top == {logprobs["tokens"][-1]: logprobs["token_logprobs"][-1]}


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, seen_params, tokenizer):
    # What eval harnesses send to score a text: the prompt's logprobs, nothing generated.
    prompt = [1, 130, 131]
    request = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    body = client.post("/v1/completions", json=request).json()
    [choice] = body["choices"]
    assert choice["text"] == tokenizer.decode(prompt) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.token_text(t) for t in prompt]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None and all(v < 0 for v in token_logprobs[1:])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert seen_params[-1].max_tokens == 1  # one token is sampled and not sent
    chunks = sse_events(client.post("/v1/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"])
            for c in chunks[:-1]] == [(choice["text"], "length")]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == token_logprobs
    assert chunks[-1]["usage"] == body["usage"]


def test_chat_logprobs_streamed_and_not(client):
    request = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
               "logprobs": True, "top_logprobs": 1, **GREEDY}
    body = client.post("/v1/chat/completions", json=request).json()
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == 2
    for entry in entries:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        # Greedy: the one alternative asked for is the sampled token itself.
        assert entry["top_logprobs"] == [{k: entry[k] for k in ("token", "logprob", "bytes")}]
    response = client.post("/v1/chat/completions", json={**request, "stream": True})
    chunks = sse_events(response.text)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:]]
    assert streamed == [[entries[0]], [entries[1]]]
    # logprobs without top_logprobs: each token's own, no alternatives.
    body = client.post("/v1/chat/completions", json={**request, "top_logprobs": None}).json()
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]


def test_malformed_json(client):
    response = client.post("/v1/completions", content=b"{'prompt': 1}",
                           headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "Malformed JSON" in error["message"]


def test_context_length_error_names_both_lengths(client, tokenizer):
    prompt = "x" * 40
    num_prompt = len(tokenizer.encode(prompt))
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and f"{num_prompt} in the prompt" in message
    assert "30 in the completion" in message


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_a_400_even_when_streaming(client, engine, stream):
    # Our checks let an out-of-vocabulary token id through; the engine's own refuse it.
    response = client.post("/v1/completions", json={"prompt": [5, 999], "stream": stream})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "out of range" in error["message"] and "999" in error["message"]
    assert error["param"] == "prompt"
    assert not engine.has_unfinished_requests()


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `nope` does not exist. Available: tiny.",
        "type": "NotFoundError", "param": "model", "code": 404}


def test_body_over_limit_is_413_with_or_without_content_length(client):
    big = json.dumps({"prompt": "x" * 4000}).encode()
    assert client.post("/v1/completions", content=big).status_code == 413

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 500):
            yield big[i:i + 500]
    response = client.post("/v1/completions", content=chunks())
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413


def test_unknown_route_and_method_are_openai_errors(client):
    assert client.get("/v1/nothing").json()["error"]["code"] == 404
    assert client.get("/v1/completions").json()["error"]["code"] == 405


def test_embeddings_on_a_generative_model_is_refused(client):
    response = client.post("/v1/embeddings", json={"input": "x"})
    assert response.status_code == 400 and "Embeddings" in response.json()["error"]["message"]


def test_models_card(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN and card["root"] == "/models/tiny"


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


# ---------------------------------------------------------------------------------------------
# Loading, failing, draining


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


# ---------------------------------------------------------------------------------------------
# Fault injection and the admin API


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


# ---------------------------------------------------------------------------------------------
# Embeddings, on the packaged MiniLM


@pytest.fixture(scope="module")
def minilm():
    from runtime.engine.encoder import EmbeddingModel, find_packaged_minilm

    return EmbeddingModel.load(find_packaged_minilm())


class GatedEncoder:
    """The real encoder, holding its first call until released so that later requests pile
    up into one batch; records what each call got."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.calls: list[list] = []
        self.release = threading.Event()

    def embed(self, inputs):
        self.calls.append(list(inputs))
        if len(self.calls) == 1:
            self.release.wait(5)
        return self.encoder.embed(inputs)


def embedder_client(encoder) -> tuple[TestClient, ReplicaServer]:
    replica = ReplicaServer(AsyncEmbedder(lambda: encoder),
                            ServerSettings(served_model_name=MODEL, model_root="/m"))
    return TestClient(replica.build_app(), raise_server_exceptions=False), replica


def close_to(got: list[float], want: list[float]) -> bool:
    return max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


def test_concurrent_embedding_requests_share_a_batch(minilm):
    encoder = GatedEncoder(minilm)
    test_client, replica = embedder_client(encoder)
    out_of_vocabulary = [10 ** 6]
    with test_client:
        wait_ready(test_client)
        results: dict[str, dict] = {}

        def post(name, value):
            results[name] = test_client.post("/v1/embeddings", json={"input": value}).json()

        first = threading.Thread(target=post, args=("a", "a"))
        first.start()
        wait_until(lambda: encoder.calls, "the first request to reach the encoder", interval=0.01)
        others = [threading.Thread(target=post, args=item) for item in (
            ("bb", "bb"), ("ccc", "ccc"), ("ids", [101, 7592, 102]), ("bad", out_of_vocabulary))]
        for thread in others:
            thread.start()
        wait_until(lambda: replica.backend.stats().num_waiting == 4, "four requests to queue", interval=0.01)
        encoder.release.set()
        for thread in [first, *others]:
            thread.join(10)
    assert encoder.calls[0] == ["a"]
    assert sorted(encoder.calls[1]) == ["bb", "ccc"]  # one call for the two texts
    assert sorted(encoder.calls[2]) == [[101, 7592, 102], out_of_vocabulary]  # and the ids
    vectors, counts = minilm.embed(["ccc"])
    assert close_to(results["ccc"]["data"][0]["embedding"], vectors[0])
    assert results["ccc"]["usage"] == {"prompt_tokens": counts[0], "total_tokens": counts[0]}
    # The bad input fails alone; its batch neighbour still gets its vector.
    assert results["bad"]["error"]["code"] == 400 and "token ids" in results["bad"]["error"][
        "message"]
    vectors, _ = minilm.embed([[101, 7592, 102]])
    assert close_to(results["ids"]["data"][0]["embedding"], vectors[0])


def test_embedding_base64_encoding(minilm):
    test_client, _ = embedder_client(minilm)
    with test_client:
        wait_ready(test_client)
        body = test_client.post("/v1/embeddings", json={
            "input": ["xy"], "encoding_format": "base64"}).json()
        raw = base64.b64decode(body["data"][0]["embedding"])
        [expected], _ = minilm.embed(["xy"])
        assert close_to(list(struct.unpack(f"<{len(raw) // 4}f", raw)), expected)
        refused = test_client.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 400 and "Embeddings API" in refused.text
        assert test_client.post("/v1/embeddings", json={"input": []}).status_code == 400


# ---------------------------------------------------------------------------------------------
# `inferops serve` options


def parse_serve_args(*argv: str, model: str = "/models/tiny"):
    import argparse

    from runtime.engine.server import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, *argv])
    return args, settings_from_args(args)


def test_serve_options_become_settings(monkeypatch):
    monkeypatch.setenv("INFEROPS_ADMIN_TOKEN", "from-env")
    args, settings = parse_serve_args(
        "--kv-cache-memory", "256MiB", "--max-body-bytes", "1MB",
        "--histogram-buckets-ttft", "0.05,0.1,1", "--fault-error-rate", "0.25")
    assert args.kv_cache_memory == 256 * 1024 ** 2 and settings.max_body_bytes == 1000 ** 2
    assert settings.histogram_buckets == {"ttft": (0.05, 0.1, 1.0)}
    assert settings.faults.fault_error_rate == 0.25
    assert settings.served_model_name == "tiny" and settings.admin_token == "from-env"


@pytest.mark.parametrize("argv", [
    ("--histogram-buckets-e2e", "1,0.5"), ("--fault-error-rate", "1.5"),
    ("--kv-cache-memory", "lots"), ("--fault-ttft-ms", "-1"),
])
def test_bad_serve_options_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_serve_args(*argv)


# ---------------------------------------------------------------------------------------------
# The scripted engine, for failures the real one cannot be made to produce


class ScriptedTokenizer:
    """One token per character; id 1 is BOS, id 2 is EOS."""

    eos_token_ids = [2]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) + 10 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 10) for i in ids if i > 2)

    def token_text(self, token_id: int) -> str:
        return chr(token_id - 10) if token_id > 2 else "</s>"

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class ScriptedEngine:
    """LLMEngine's API, scripted: every running choice emits the letter 'a' + index per step
    until max_tokens, with logprobs of -0.25 * its position ('z' at -3 and EOS at -inf as the
    alternatives). `fail_on_step` makes step() raise, as a CUDA error or an OOM would."""

    max_model_len = MAX_MODEL_LEN

    def __init__(self, fail_on_step: bool = False) -> None:
        self.tokenizer = ScriptedTokenizer()
        self.fail_on_step = fail_on_step
        self.running: dict[tuple[str, int], dict] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_request(self, request_id, prompt_token_ids, params, priority=0) -> None:
        self.prompt_tokens_total += len(prompt_token_ids)
        for index in range(params.n):
            self.running[(request_id, index)] = {"params": params, "count": 0,
                                                 "prompt_ids": list(prompt_token_ids)}

    def abort_request(self, request_id) -> None:
        for key in [k for k in self.running if k[0] == request_id]:
            del self.running[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        if self.fail_on_step:
            raise RuntimeError("simulated CUDA error")
        outputs = []
        for (request_id, index), seq in list(self.running.items()):
            seq["count"] += 1
            self.generation_tokens_total += 1
            finished = seq["count"] >= seq["params"].max_tokens
            if finished:
                del self.running[(request_id, index)]
            token_id = ord("a") + index + 10
            outputs.append(SimpleNamespace(
                request_id=request_id, index=index, new_token_ids=[token_id],
                new_text=chr(ord("a") + index), finished=finished,
                finish_reason="length" if finished else None,
                num_prompt_tokens=len(seq["prompt_ids"]), num_output_tokens=seq["count"],
                num_cached_tokens=0, logprobs=self.logprobs(seq, token_id),
                prompt_logprobs=self.prompt_logprobs(seq, index), stop_reason=None))
        return outputs

    @staticmethod
    def prompt_logprobs(seq: dict, index: int) -> list[TokenLogprob] | None:
        """On sequence 0's first output: -1.0 for each prompt token after the first."""
        if seq["params"].prompt_logprobs is None or index or seq["count"] > 1:
            return None
        first, *rest = seq["prompt_ids"]
        return [TokenLogprob(first, None, ())] + [TokenLogprob(t, -1.0, ()) for t in rest]

    @staticmethod
    def logprobs(seq: dict, token_id: int) -> list[TokenLogprob] | None:
        k = seq["params"].logprobs
        if k is None:
            return None
        logprob = -0.25 * seq["count"]
        top = ((token_id, logprob), (ord("z") + 10, -3.0), (2, float("-inf")))
        return [TokenLogprob(token_id, logprob, top[:k])]

    def stats(self):
        return SimpleNamespace(num_running=len(self.running), num_waiting=0, kv_cache_usage=0.0,
                               num_preemptions_total=0, prefix_cache_queries_total=0,
                               prefix_cache_hits_total=0,
                               prompt_tokens_total=self.prompt_tokens_total,
                               generation_tokens_total=self.generation_tokens_total)


@pytest.fixture
def scripted_client():
    test_client, _ = make_client(lambda: ScriptedEngine())
    with test_client:
        wait_ready(test_client)
        yield test_client


# Prompts whose greedy tokens on the tiny checkpoint read as whole characters before the
# last one, so the real engine's streams have a chunk between the first and the last too.
SHAPE_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "logprobs": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 1, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}],
                              "max_tokens": 3, "logprobs": True, "top_logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}],
                              "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}}),
]
SSE_FRAMING = re.compile(r"(data: \{[^\n]*\}\n\n)+data: \[DONE\]\n\n")


def shape(value, key: str | None = None):
    """The JSON keys and types of a value, not its contents: a list's shape is the set of
    its items' shapes, so the scripted engine's letters and the real one's tokens compare.
    Completions' `top_logprobs` maps token texts to logprobs: its keys are contents too."""
    if isinstance(value, dict):
        if key == "top_logprobs" and "token" not in value:
            return {"<token>": sorted({shape(item) for item in value.values()})}
        return {name: shape(item, name) for name, item in value.items()}
    if isinstance(value, list):
        shapes = []
        for item in (shape(item, key) for item in value):
            if item not in shapes:
                shapes.append(item)
        return ["list", *sorted(shapes, key=repr)]
    return type(value).__name__


def answer_shapes(client: TestClient) -> list:
    shapes = []
    for path, request in SHAPE_REQUESTS:
        response = client.post(path, json={**request, **GREEDY})
        assert response.status_code == 200, response.text
        headers = {key: response.headers[key]
                   for key in ("content-type", "cache-control", "x-accel-buffering")
                   if key in response.headers}
        if request.get("stream"):
            assert SSE_FRAMING.fullmatch(response.text), response.text
            events = [shape(e) for e in sse_events(response.text)]
            # The real engine's text may hold a token back (a partial character), so count
            # kinds of chunk, not chunks: the distinct shapes in the order they first appear.
            body = [s for i, s in enumerate(events) if s not in events[:i]]
        else:
            body = shape(response.json())
        shapes.append((path, headers, body))
    return shapes


def test_the_scripted_engine_answers_in_the_real_engines_shapes(client, scripted_client):
    assert answer_shapes(scripted_client) == answer_shapes(client)


def test_a_minus_infinite_logprob_is_written_as_vllm_writes_it(scripted_client):
    # JSON has no infinities; vLLM writes -9999.0. The real engine's logprobs come from
    # finite logits, so only the scripted one can send -inf.
    body = scripted_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                         "logprobs": 3}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {"a": -0.25, "z": -3.0, "</s>": -9999.0}]


def test_dead_loop_fails_requests_and_health_instead_of_hanging():
    test_client, _ = make_client(lambda: ScriptedEngine(fail_on_step=True))
    with test_client:
        wait_ready(test_client)
        response = test_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 500
        assert "engine loop has stopped" in response.json()["error"]["message"]
        assert "Traceback" not in response.text
        assert test_client.get("/health").status_code == 503
        assert test_client.post("/v1/completions", json={"prompt": "x"}).status_code == 500


def test_dead_loop_mid_stream_sends_an_error_event():
    test_client, _ = make_client(lambda: ScriptedEngine(fail_on_step=True))
    with test_client:
        wait_ready(test_client)
        response = test_client.post("/v1/completions",
                                    json={"prompt": "x", "max_tokens": 2, "stream": True})
        events = sse_events(response.text)
        assert events[-1]["error"]["code"] == 500


class CrashingEncoder:
    """An encoder whose forward pass raises what no input error is (a kernel fault)."""

    def embed(self, inputs):
        raise RuntimeError("simulated encoder crash")


def test_encoder_crash_fails_its_requests_instead_of_hanging():
    test_client, _ = embedder_client(CrashingEncoder())
    with test_client:
        wait_ready(test_client)
        crashed = test_client.post("/v1/embeddings", json={"input": "crash"})
        assert crashed.status_code == 500 and "stopped" in crashed.json()["error"]["message"]
        assert test_client.get("/health").json()["status"] == "dead"
