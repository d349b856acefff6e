"""Embeddings on the packaged MiniLM: batching of concurrent requests, base64 encoding."""

from __future__ import annotations

import base64
import struct
import threading

import pytest

from tests.runtime.engine.replica_http import embedder_client, wait_ready
from tests.waiting import wait_until


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
