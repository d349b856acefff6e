"""Cosine similarity of two texts' embeddings from the all-MiniLM-L6-v2 the platform ships
(runtime/engine/encoder.py): loaded once per process, run in a thread so an eval run's event
loop keeps its other requests going."""

from __future__ import annotations

import asyncio
import functools
import threading

# EmbeddingModel.embed() takes one thread at a time; the first call also loads the model.
_lock = threading.Lock()


@functools.cache
def embedding_model():
    # Imported here: torch loads only in a process that scores similarity.
    try:
        from runtime.engine.encoder import EmbeddingModel, find_packaged_minilm

        return EmbeddingModel.load(find_packaged_minilm())
    except ImportError as exc:
        raise RuntimeError(f"similarity scoring needs the embedding model on the worker ({exc}): install the "
                           "engine extra there (pip install 'inferops[engine]')") from exc


def cosine_similarity_now(text: str, other: str) -> float:
    with _lock:
        (vector, other_vector), _ = embedding_model().embed([text, other])
    # The encoder's vectors are unit length, so their dot product is the cosine.
    return sum(a * b for a, b in zip(vector, other_vector, strict=True))


async def cosine_similarity(text: str, other: str) -> float:
    return await asyncio.to_thread(cosine_similarity_now, text, other)
