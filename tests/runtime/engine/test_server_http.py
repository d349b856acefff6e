"""HTTP-layer tests of the replica server against a scripted engine.

The engine here is a stand-in that follows LLMEngine's API (tokenizer, add_request, step,
abort_request, stats) so these tests can pin exact response shapes, error bodies and the
loop-thread failure paths in-process and in milliseconds. Everything model-related is proven
end to end against the real engine in test_server_e2e.py.
"""

from __future__ import annotations

import base64
import json
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

MODEL = "fake"
REFUSED_TOKEN = 999
NAN_TOKEN = 998  # the scripted engine fails a request holding it as NaN logits would


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
    """Every running choice emits the letter 'a' + index per step until max_tokens."""

    max_model_len = 64

    def __init__(self, step_seconds: float = 0.0, fail_on_step: bool = False) -> None:
        self.tokenizer = ScriptedTokenizer()
        self.step_seconds = step_seconds
        self.fail_on_step = fail_on_step
        self.running: dict[tuple[str, int], dict] = {}
        self.aborted: list[str] = []
        self.seen_params: list = []  # (request id, SamplingParams) per add_request
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def add_request(self, request_id, prompt_token_ids, params, priority=0) -> None:
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("too long")
        if REFUSED_TOKEN in prompt_token_ids:
            raise ValueError("the engine refuses token 999")
        self.prompt_tokens_total += len(prompt_token_ids)
        self.seen_params.append((request_id, params))
        for index in range(params.n):
            self.running[(request_id, index)] = {"params": params, "count": 0,
                                                 "prompt_ids": list(prompt_token_ids),
                                                 "nan": NAN_TOKEN in prompt_token_ids}

    def abort_request(self, request_id) -> None:
        self.aborted.append(request_id)
        for key in [k for k in self.running if k[0] == request_id]:
            del self.running[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        if self.fail_on_step:
            raise RuntimeError("simulated CUDA error")
        time.sleep(self.step_seconds)
        outputs = []
        for (request_id, index), seq in list(self.running.items()):
            if seq["nan"]:  # as LLMEngine does: no token, the request ends with "error"
                del self.running[(request_id, index)]
                outputs.append(SimpleNamespace(
                    request_id=request_id, index=index, new_token_ids=[], new_text="",
                    finished=True, finish_reason="error",
                    num_prompt_tokens=len(seq["prompt_ids"]), num_output_tokens=seq["count"],
                    num_cached_tokens=0, logprobs=None, prompt_logprobs=None,
                    stop_reason=None))
                continue
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
        """The sampled token at -0.25 * its position, then 'z' and EOS (-inf) as alternatives."""
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


def make_client(load, **settings) -> tuple[TestClient, ReplicaServer]:
    replica = ReplicaServer(AsyncEngine(load),
                            ServerSettings(served_model_name=MODEL, model_root="/models/fake",
                                           **settings))
    return TestClient(replica.build_app(), raise_server_exceptions=False), replica


def wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 5
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "engine never became ready"
        time.sleep(0.01)


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


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


def test_completion_shape_and_usage(client):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "aaa", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert response.headers["x-request-id"] == body["id"]


def test_generation_config_fills_in_what_a_request_leaves_out(engine):
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
    first, second = [params for _, params in engine.seen_params]
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
    from inferops.cli import main

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "top_p" in caplog.text and "--no-generation-config" in caplog.text


def test_prompt_as_token_ids_and_n(client):
    body = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2,
                                                "n": 2}).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "aa"), (1, "bb")]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_chat_stream_with_usage(client):
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "yo"}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert events[0]["id"].startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert "".join(contents) == "aa"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    prompt_len = len("<user>yo<assistant>")
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 2,
                                   "total_tokens": prompt_len + 2}


def test_completion_stream_without_usage(client):
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                    "stream": True})
    events = sse_events(response.text)
    assert [e["choices"][0]["text"] for e in events] == ["a", "a"]
    assert all("usage" not in e for e in events)


def test_chat_defaults_max_tokens_to_remaining_context(client, engine):
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    }).json()
    prompt_len = len("<system>d<user>u<assistant>")
    assert body["usage"]["completion_tokens"] == engine.max_model_len - prompt_len
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": "a" * (64 - prompt_len)}


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


def test_penalties_bias_and_min_tokens_reach_the_engine(client, engine):
    response = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "presence_penalty": -2, "frequency_penalty": 1.5,
        "repetition_penalty": 1.2, "logit_bias": {"7": -100, "12": 2.5}, "min_tokens": 2})
    assert response.status_code == 200, response.text
    [(_, params)] = engine.seen_params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        -2.0, 1.5, 1.2)
    assert params.logit_bias == {7: -100.0, 12: 2.5} and params.min_tokens == 2


def test_completion_logprobs_in_openais_legacy_shape(client):
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "n": 2,
                                                "logprobs": 2}).json()
    first, second = body["choices"]
    assert first["text"] == "aaa" and first["logprobs"] == {
        "text_offset": [0, 1, 2],
        "token_logprobs": [-0.25, -0.5, -0.75],
        "tokens": ["a", "a", "a"],
        "top_logprobs": [{"a": -0.25, "z": -3.0}, {"a": -0.5, "z": -3.0},
                         {"a": -0.75, "z": -3.0}],
    }
    assert second["logprobs"]["tokens"] == ["b", "b", "b"]
    # logprobs=0: the sampled token only; -inf is written as vLLM writes it, JSON has no inf.
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.25}]
    body = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                "logprobs": 3}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [
        {"a": -0.25, "z": -3.0, "</s>": -9999.0}]


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client, engine):
    body = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 2,
                                                "echo": True}).json()
    assert body["choices"][0]["text"] == "xyaa" and body["choices"][0]["logprobs"] is None
    assert engine.seen_params[-1][1].prompt_logprobs is None  # no logprobs: none computed
    body = client.post("/v1/completions", json={"prompt": "xy", "max_tokens": 1, "echo": True,
                                                "logprobs": 1}).json()
    assert body["choices"][0]["text"] == "xya"
    assert body["choices"][0]["logprobs"] == {
        "text_offset": [0, 4, 5, 6],  # BOS reads "</s>", then one character a token
        "token_logprobs": [None, -1.0, -1.0, -0.25],
        "tokens": ["</s>", "x", "y", "a"],
        "top_logprobs": [None, {"x": -1.0}, {"y": -1.0}, {"a": -0.25}],
    }


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client, engine):
    # What eval harnesses send to score a text: the prompt's logprobs, nothing generated.
    request = {"prompt": [1, 130, 131], "max_tokens": 0, "echo": True, "logprobs": 0}
    body = client.post("/v1/completions", json=request).json()
    [choice] = body["choices"]
    assert choice["text"] == "xy" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["</s>", "x", "y"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert engine.seen_params[-1][1].max_tokens == 1  # one token is sampled and not sent
    chunks = sse_events(client.post("/v1/completions", json={
        **request, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"])
            for c in chunks[:-1]] == [("xy", "length")]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0, -1.0]
    assert chunks[-1]["usage"] == body["usage"]


def test_chat_logprobs_streamed_and_not(client):
    request = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
               "logprobs": True, "top_logprobs": 1}
    expected = [{"token": "a", "logprob": -0.25, "bytes": [97],
                 "top_logprobs": [{"token": "a", "logprob": -0.25, "bytes": [97]}]},
                {"token": "a", "logprob": -0.5, "bytes": [97],
                 "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}]
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["choices"][0]["logprobs"] == {"content": expected}
    response = client.post("/v1/chat/completions", json={**request, "stream": True})
    chunks = sse_events(response.text)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:]]
    assert streamed == [[expected[0]], [expected[1]]]
    # logprobs without top_logprobs: each token's own, no alternatives.
    body = client.post("/v1/chat/completions", json={**request, "top_logprobs": None}).json()
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]


def test_malformed_json(client):
    response = client.post("/v1/completions", content=b"{'prompt': 1}",
                           headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "Malformed JSON" in error["message"]


def test_context_length_error_names_both_lengths(client):
    response = client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 30})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "64" in message and "41 in the prompt" in message and "30 in the completion" in message


@pytest.mark.parametrize("stream", [False, True])
def test_engine_refusal_is_a_400_even_when_streaming(client, engine, stream):
    response = client.post("/v1/completions", json={"prompt": [5, REFUSED_TOKEN],
                                                    "stream": stream})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "the engine refuses token 999"
    assert not engine.running


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `nope` does not exist. Available: fake.",
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
    assert card["max_model_len"] == 64 and card["root"] == "/models/fake"


def test_metrics_follow_vllm_names(client):
    client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 4})
    families = {f.name: f for f in text_string_to_metric_families(
        client.get("/metrics").text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert families[name].type == "histogram"
    samples = {(s.name, s.labels.get("finished_reason")): s for f in families.values()
               for s in f.samples}
    assert samples[("vllm:generation_tokens_total", None)].value == 4
    assert samples[("vllm:prompt_tokens_total", None)].value == 4
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


def test_failed_load_reports_the_error():
    def broken_load():
        raise FileNotFoundError("no weights")

    test_client, replica = make_client(broken_load)
    with test_client:
        deadline = time.monotonic() + 5
        while replica.backend.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.01)
        health = test_client.get("/health")
        assert health.status_code == 503 and "no weights" in health.json()["error"]
        assert test_client.post("/v1/completions", json={"prompt": "x"}).status_code == 500


def test_dead_loop_fails_requests_and_health_instead_of_hanging():
    engine = ScriptedEngine(fail_on_step=True)
    test_client, _ = make_client(lambda: engine)
    with test_client:
        wait_ready(test_client)
        response = test_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert response.status_code == 500
        assert "engine loop has stopped" in response.json()["error"]["message"]
        assert "Traceback" not in response.text
        assert test_client.get("/health").status_code == 503
        assert test_client.post("/v1/completions", json={"prompt": "x"}).status_code == 500


def test_dead_loop_mid_stream_sends_an_error_event():
    engine = ScriptedEngine(fail_on_step=True)
    test_client, _ = make_client(lambda: engine)
    with test_client:
        wait_ready(test_client)
        response = test_client.post("/v1/completions",
                                    json={"prompt": "x", "max_tokens": 2, "stream": True})
        events = sse_events(response.text)
        assert events[-1]["error"]["code"] == 500


def test_nan_logits_fail_that_request_only_and_say_what_to_try(client):
    prompt = [1, NAN_TOKEN, 20]
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
    assert response.status_code == 500
    error = response.json()["error"]
    assert "NaN or infinite" in error["message"] and "--dtype float32" in error["message"]
    streamed = client.post("/v1/completions",
                           json={"prompt": prompt, "max_tokens": 3, "n": 2, "stream": True})
    events = sse_events(streamed.text)
    assert events[-1]["error"]["code"] == 500 and "NaN" in events[-1]["error"]["message"]
    assert client.get("/health").status_code == 200  # the replica itself is fine
    fine = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == "aa"
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(client.get("/metrics").text)
               for s in f.samples}
    assert samples[("vllm:request_success_total", "error")] == 2
    assert samples[("vllm:request_success_total", "length")] == 1


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


class BlockingEncoder:
    """Holds its first call until released, so later requests pile up into one batch."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.release = threading.Event()

    def embed(self, inputs):
        self.calls.append(list(inputs))
        if len(self.calls) == 1:
            self.release.wait(5)
        if any(isinstance(x, str) and x == "bad" for x in inputs):
            raise ValueError("bad input")
        if "crash" in inputs:
            raise RuntimeError("simulated encoder crash")
        return [[float(len(x)), 0.5] for x in inputs], [len(x) for x in inputs]


def test_concurrent_embedding_requests_share_a_batch():
    encoder = BlockingEncoder()
    replica = ReplicaServer(AsyncEmbedder(lambda: encoder),
                            ServerSettings(served_model_name=MODEL, model_root="/m"))
    with TestClient(replica.build_app()) as test_client:
        wait_ready(test_client)
        results: dict[str, dict] = {}

        def post(text):
            results[text] = test_client.post("/v1/embeddings", json={"input": text}).json()

        first = threading.Thread(target=post, args=("a",))
        first.start()
        while not encoder.calls:
            time.sleep(0.01)
        others = [threading.Thread(target=post, args=(t,)) for t in ("bb", "ccc", "bad")]
        for thread in others:
            thread.start()
        while replica.backend.stats().num_waiting < 3:
            time.sleep(0.01)
        encoder.release.set()
        for thread in [first, *others]:
            thread.join(5)
    assert encoder.calls[0] == ["a"]
    assert sorted(encoder.calls[1]) == ["bad", "bb", "ccc"]  # one batch for the three
    assert results["ccc"]["data"][0]["embedding"] == [3.0, 0.5]
    assert results["ccc"]["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    # The bad input fails alone; its batch neighbours still get their vectors.
    assert results["bad"]["error"]["code"] == 400
    assert results["bb"]["data"][0]["embedding"] == [2.0, 0.5]


def test_embedding_base64_encoding():
    encoder = BlockingEncoder()
    encoder.release.set()
    replica = ReplicaServer(AsyncEmbedder(lambda: encoder),
                            ServerSettings(served_model_name=MODEL, model_root="/m"))
    with TestClient(replica.build_app()) as test_client:
        wait_ready(test_client)
        body = test_client.post("/v1/embeddings", json={
            "input": ["xy"], "encoding_format": "base64"}).json()
        assert struct.unpack("<2f", base64.b64decode(body["data"][0]["embedding"])) == (2.0, 0.5)
        refused = test_client.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 400 and "Embeddings API" in refused.text
        assert test_client.post("/v1/embeddings", json={"input": []}).status_code == 400


def test_interrupted_requests_end_cleanly_and_are_aborted():
    # What a drain that timed out does: streams get an error event and [DONE], the
    # engine drops the requests, and the metrics count them as aborted.
    engine = ScriptedEngine(step_seconds=0.01)
    test_client, replica = make_client(lambda: engine)
    with test_client:
        wait_ready(test_client)
        result = {}

        def stream():
            result["text"] = test_client.post("/v1/completions", json={
                "prompt": "x", "max_tokens": 50, "stream": True}).text

        worker = threading.Thread(target=stream)
        worker.start()
        while not engine.running:
            time.sleep(0.01)
        interrupted = test_client.portal.call(
            replica.backend.interrupt_all, EngineUnavailableError("stopped"))
        worker.join(5)
        metrics = test_client.get("/metrics").text
        deadline = time.monotonic() + 5
        while not engine.aborted:  # the loop thread applies the abort between two steps
            assert time.monotonic() < deadline, "the engine never saw the abort"
            time.sleep(0.01)
    assert interrupted == 1
    events = sse_events(result["text"])
    assert events[-1]["error"]["code"] == 503
    assert "shutting down" in events[-1]["error"]["message"]
    assert len(events) < 50 and not engine.running
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="fake"} 1.0' \
        in metrics


def parse_serve_args(*argv: str):
    import argparse

    from runtime.engine.server import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "/models/tiny", *argv])
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


def test_encoder_crash_fails_its_requests_instead_of_hanging():
    encoder = BlockingEncoder()
    encoder.release.set()
    replica = ReplicaServer(AsyncEmbedder(lambda: encoder),
                            ServerSettings(served_model_name=MODEL, model_root="/m"))
    with TestClient(replica.build_app(), raise_server_exceptions=False) as test_client:
        wait_ready(test_client)
        crashed = test_client.post("/v1/embeddings", json={"input": "crash"})
        assert crashed.status_code == 500 and "stopped" in crashed.json()["error"]["message"]
        assert test_client.get("/health").json()["status"] == "dead"


def test_metric_families_match_a_real_vllm_scrape(client):
    """Same names, types, label names and default buckets as vLLM 0.32's /metrics."""
    from pathlib import Path

    recorded = Path(__file__).resolve().parents[3] / "bench/scrape/vllm-0.32-cpu-metrics.txt"
    vllm = {f.name: f for f in text_string_to_metric_families(recorded.read_text())}
    ours = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)
            if f.name.startswith("vllm:") and not f.name.endswith("_created")}
    assert len(ours) == 14  # 5 histograms, 3 gauges, 6 counters
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
