"""Bad requests get OpenAI's error shape naming the field and the reason, never a server error."""

from __future__ import annotations

import json

import pytest

from tests.runtime.engine.replica_http import MAX_MODEL_LEN


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
