"""The replica client against a real `inferops serve` of the tiny checkpoint: greedy answers
with their tokens, lm-eval's log-likelihoods, retries while a replica cannot take a request,
and errors that say what the replica answered."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from evals.scoring import client as client_module
from evals.scoring.client import ReplicaClient, ReplicaError
from tests.conftest import free_port
from tests.evals.replica import MAX_MODEL_LEN, MODEL, Replica

LOWEST_PRIORITY = -1000


def call(base_url: str, method: str, *args, priority: int | None = LOWEST_PRIORITY, **kwargs):
    """One client call in its own event loop, the client closed after it."""

    async def run():
        client = ReplicaClient(base_url, MODEL, priority=priority)
        try:
            return await getattr(client, method)(*args, **kwargs)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_greedy_completion_with_its_tokens(replica):
    case = {"id": "a", "prompt": "The quick brown", "max_tokens": 6}
    generation = call(replica.base_url, "greedy", case)
    direct = httpx.post(f"{replica.base_url}/v1/completions", json={
        "prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "logprobs": 0}).json()
    assert generation.text == direct["choices"][0]["text"]
    assert generation.tokens == direct["choices"][0]["logprobs"]["tokens"]
    assert generation.completion_tokens == len(generation.tokens) == 6
    assert generation.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert generation.latency_ms > 0


def test_greedy_is_the_same_every_time_with_or_without_a_priority(replica):
    case = {"id": "a", "prompt": "Hello world!", "max_tokens": 8}
    first = call(replica.base_url, "greedy", case)
    again = call(replica.base_url, "greedy", case, priority=None)
    assert (again.text, again.tokens) == (first.text, first.tokens)


def test_greedy_chat_with_its_tokens(replica):
    case = {"id": "c", "messages": [{"role": "user", "content": "Hello world!"}],
            "max_tokens": 5}
    generation = call(replica.base_url, "greedy", case)
    direct = httpx.post(f"{replica.base_url}/v1/chat/completions", json={
        "messages": case["messages"], "max_tokens": 5, "temperature": 0}).json()
    assert generation.text == direct["choices"][0]["message"]["content"]
    assert len(generation.tokens) == generation.completion_tokens == 5
    assert generation.prompt_tokens == direct["usage"]["prompt_tokens"]


def test_the_case_max_tokens_defaults_to_64(replica):
    generation = call(replica.base_url, "greedy", {"id": "d", "prompt": "x",
                                                   "max_tokens": None})
    assert generation.completion_tokens <= 64 < MAX_MODEL_LEN


def test_loglikelihoods_follow_the_chain_rule(replica):
    # Words are pre-tokenized apart (byte-level BPE splits at spaces), so the joint
    # log-likelihood of " brown fox" is that of " brown" plus " fox" after it: the
    # continuation positions are summed exactly, none of the context's and no generated one.
    [joint] = call(replica.base_url, "loglikelihoods", "The quick", [" brown fox"])
    [first] = call(replica.base_url, "loglikelihoods", "The quick", [" brown"])
    [second] = call(replica.base_url, "loglikelihoods", "The quick brown", [" fox"])
    assert joint == pytest.approx(first + second, abs=1e-4)
    assert joint < first < 0 and second < 0


def test_a_contexts_trailing_space_moves_onto_the_continuation(replica):
    moved = call(replica.base_url, "loglikelihoods", "The quick ", ["brown", "fox"])
    assert moved == pytest.approx(
        call(replica.base_url, "loglikelihoods", "The quick", [" brown", " fox"]), abs=1e-6)


def test_a_single_token_continuation_is_the_greedy_logprob(replica):
    # The greedy next token after the context's tokens, with its logprob, from the engine.
    context_ids = httpx.post(f"{replica.base_url}/tokenize", json={
        "prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    direct = httpx.post(f"{replica.base_url}/v1/completions", json={
        "prompt": context_ids, "max_tokens": 1, "temperature": 0, "logprobs": 0}).json()
    logprobs = direct["choices"][0]["logprobs"]
    token, logprob = logprobs["tokens"][0], logprobs["token_logprobs"][0]
    assert token.strip(), f"the greedy token {token!r} is whitespace: pick another context"
    [scored] = call(replica.base_url, "loglikelihoods", "Hello world", [token])
    assert scored == pytest.approx(logprob, abs=1e-4)


def test_score_continuations_counts_usage(replica):
    scored = call(replica.base_url, "score_continuations", "The quick", [" brown", " dog"])
    assert len(scored.loglikelihoods) == 2
    # Each choice is one echo request: its prompt, and the one token generated and dropped.
    assert scored.completion_tokens == 2 and scored.prompt_tokens >= 4
    assert scored.latency_ms > 0


def test_a_chat_context(replica):
    messages = [{"role": "user", "content": "Hello world!"}]
    lls = call(replica.base_url, "loglikelihoods", messages, [" The", " quick"])
    assert len(lls) == 2 and all(ll < 0 for ll in lls)


def test_an_empty_context_conditions_on_bos(replica):
    [alone] = call(replica.base_url, "loglikelihoods", "", ["Hello world"])
    [after_bos] = call(replica.base_url, "loglikelihoods", "<s>", ["Hello world"])
    assert alone == pytest.approx(after_bos, abs=1e-4)


def test_a_refusal_says_what_the_replica_answered(replica):
    with pytest.raises(ReplicaError) as refused:
        call(replica.base_url, "greedy", {"id": "x", "prompt": "x",
                                          "max_tokens": MAX_MODEL_LEN + 1})
    assert refused.value.status == 400 and "maximum context length" in str(refused.value)
    client = ReplicaClient(replica.base_url, "another-model", priority=None)
    with pytest.raises(ReplicaError) as unknown:
        asyncio.run(client.greedy({"id": "x", "prompt": "x"}))
    assert unknown.value.status == 404 and "another-model" in str(unknown.value)


def test_a_v1_base_url_means_the_same_server(replica):
    client = ReplicaClient(f"{replica.base_url}/v1/", MODEL, priority=None)
    assert client.base_url == replica.base_url


def test_an_unreachable_replica_is_retried_then_named(monkeypatch):
    monkeypatch.setattr(client_module, "RETRY_DELAYS_S", (0.01, 0.01))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ReplicaError) as failed:
        call(url, "greedy", {"id": "x", "prompt": "x"})
    assert failed.value.status is None
    assert "unreachable after 3 attempts" in str(failed.value) and url in str(failed.value)


def test_a_loading_replica_is_waited_for(tiny_llama_dir, tmp_path, monkeypatch):
    # A replica answers 503 until its model has loaded: the client asks again until it can.
    monkeypatch.setattr(client_module, "RETRY_DELAYS_S", (0.25,) * 400)
    loading = Replica(tiny_llama_dir, tmp_path / "serve.log").start()
    try:
        assert loading.first_health() == 503
        tokens, max_model_len = call(loading.base_url, "tokenize", "Hello world!")
        assert tokens and max_model_len == MAX_MODEL_LEN
    finally:
        loading.stop()
