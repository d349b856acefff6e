"""/tokenize in vLLM's shape on the real engine: a prompt's or a chat's token ids, the context
length beside them, and OpenAI-style errors naming the field."""

from __future__ import annotations

import pytest

from tests.runtime.engine.replica_http import MAX_MODEL_LEN, MODEL, embedder_client, wait_ready

CHAT = [{"role": "user", "content": "Hello world!"}]


def test_a_prompt_with_and_without_special_tokens(client, tokenizer):
    body = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world!",
                                          "add_special_tokens": True}).json()
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    assert body == {"count": len(ids) + 1, "max_model_len": MAX_MODEL_LEN,
                    "tokens": [tokenizer.bos_token_id, *ids], "token_strs": None}
    bare = client.post("/tokenize", json={"prompt": "Hello world!",
                                          "add_special_tokens": False}).json()
    assert bare["tokens"] == ids and bare["count"] == len(ids)
    # vLLM's default for a prompt: the special tokens, as /v1/completions would add them.
    assert client.post("/tokenize", json={"prompt": "Hello world!"}).json() == body


def test_the_tokens_are_what_a_completion_counts(client):
    counted = client.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["count"]
    usage = client.post("/v1/completions", json={"prompt": "The quick brown fox",
                                                 "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == counted


def test_token_strings_on_request(client, tokenizer):
    body = client.post("/tokenize", json={"prompt": "fox", "add_special_tokens": False,
                                          "return_token_strs": True}).json()
    assert body["token_strs"] == [tokenizer.backend.id_to_token(t) for t in body["tokens"]]
    assert "".join(body["token_strs"]) == "fox"


def test_chat_messages_through_the_template(client, tokenizer):
    body = client.post("/tokenize", json={"messages": CHAT}).json()
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    # The template writes BOS itself; the chat shape adds no special tokens by default.
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["tokens"][0] == tokenizer.bos_token_id
    usage = client.post("/v1/chat/completions", json={"messages": CHAT,
                                                      "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == body["count"]
    without = client.post("/tokenize", json={"messages": CHAT,
                                             "add_generation_prompt": False}).json()
    assert without["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(CHAT, add_generation_prompt=False),
        add_special_tokens=False)
    assert without["count"] < body["count"]


def test_an_empty_prompt_is_just_its_special_tokens(client, tokenizer):
    body = client.post("/tokenize", json={"prompt": ""}).json()
    assert body["tokens"] == [tokenizer.bos_token_id] and body["count"] == 1


@pytest.mark.parametrize("payload, status, param, fragment", [
    ({}, 400, "prompt", "required"),
    ({"prompt": 5}, 400, "prompt", "must be a string"),
    ({"prompt": [1, 2]}, 400, "prompt", "must be a string"),
    ({"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ({"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs", "boolean"),
    ({"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt",
     "Unrecognized"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized"),
    ({"messages": []}, 400, "messages", "non-empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "tool"),
    ({"messages": CHAT, "prompt": "x"}, 400, "prompt", "Unrecognized"),
    ([1], 400, "body", "JSON object"),
    ({"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
])
def test_bad_input_names_the_field(client, payload, status, param, fragment):
    response = client.post("/tokenize", json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert error["code"] == status


def test_an_embedding_model_has_no_tokenize():
    from runtime.engine.encoder import EmbeddingModel, find_packaged_minilm

    client, _ = embedder_client(EmbeddingModel.load(find_packaged_minilm()))
    with client:
        wait_ready(client)
        response = client.post("/tokenize", json={"prompt": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"
