"""Logprobs as OpenAI and vLLM write them (completions' legacy shape, echo, chat), on the real
engine: a greedy choice's token heads its own alternatives."""

from __future__ import annotations

from tests.runtime.engine.replica_http import GREEDY, sse_events


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
