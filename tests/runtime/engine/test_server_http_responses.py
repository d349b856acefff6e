"""The replica server's answers to good requests, on the real engine (tiny random Llama).

Random weights write no text worth pinning, so a test checks what the engine and its tokenizer
say instead: token counts, each token's text, streamed text equal to the non-streamed text.
"""

from __future__ import annotations

from tests.runtime.engine.replica_http import GREEDY, MAX_MODEL_LEN, MODEL, sse_events


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


def test_models_card(client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN and card["root"] == "/models/tiny"
