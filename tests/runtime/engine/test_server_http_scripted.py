"""A scripted engine, for the failures the real one cannot be made to produce: its loop thread
dying in the middle of a step (a CUDA error, running out of memory), an encoder crashing the same
way, and a logprob of -inf (the real one reports the log-softmax of finite logits).

`test_the_scripted_engine_answers_in_the_real_engines_shapes` proves that what the scripted one
sends has the same JSON keys and types, and the same SSE framing, as the real one.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from runtime.engine.sampling import TokenLogprob
from tests.runtime.engine.replica_http import (
    GREEDY,
    MAX_MODEL_LEN,
    embedder_client,
    make_client,
    sse_events,
    wait_ready,
)


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

    def add_request(self, request_id, prompt_token_ids, params, priority=0, arrival_time=None,
                    targets=None) -> None:
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
