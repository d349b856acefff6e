"""The embeddings encoder against transformers' BertModel on the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from runtime.engine.encoder import EmbeddingModel, find_packaged_minilm, read_weights

torch.set_num_threads(2)

SENTENCES = [
    "A cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Quarterly revenue grew by ten percent.",
    "The replica streams tokens back to the gateway over server-sent events.",
]


@pytest.fixture(scope="session")
def minilm() -> EmbeddingModel:
    return EmbeddingModel.load(find_packaged_minilm())


@pytest.fixture(scope="session")
def reference_bert():
    from transformers import BertModel

    return BertModel.from_pretrained(find_packaged_minilm()).eval()


def reference_vectors(bert, token_lists: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' recipe: BertModel, mean over the mask, L2 normalise."""
    longest = max(len(ids) for ids in token_lists)
    input_ids = torch.tensor([ids + [0] * (longest - len(ids)) for ids in token_lists])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in token_lists])
    with torch.no_grad():
        states = bert(input_ids=input_ids, attention_mask=mask).last_hidden_state
    pooled = (states * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
    return F.normalize(pooled, dim=1)


def test_find_packaged_minilm_points_at_a_bert_folder():
    model_dir = find_packaged_minilm()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "bert"
    assert (model_dir / "model.safetensors").is_file()


def test_vectors_match_transformers_bert_with_mean_pooling(minilm, reference_bert):
    vectors, counts = minilm.embed(SENTENCES)
    token_lists = [minilm.tokenizer.encode(text).ids for text in SENTENCES]
    expected = reference_vectors(reference_bert, token_lists)
    assert counts == [len(ids) for ids in token_lists]
    assert (torch.tensor(vectors) - expected).abs().max().item() < 1e-5
    assert len(vectors[0]) == minilm.dimensions == 384
    assert torch.allclose(torch.tensor(vectors).norm(dim=1), torch.ones(len(SENTENCES)))


def test_similar_sentences_score_higher_than_unrelated(minilm):
    vectors = torch.tensor(minilm.embed(SENTENCES)[0])
    cat_kitten = vectors[0] @ vectors[1]
    assert cat_kitten > vectors[0] @ vectors[2] + 0.3
    assert cat_kitten > vectors[1] @ vectors[3] + 0.3


def test_batch_equals_one_by_one(minilm):
    batched, batched_counts = minilm.embed(SENTENCES)
    for index, text in enumerate(SENTENCES):
        alone, alone_counts = minilm.embed([text])
        assert alone_counts == [batched_counts[index]]
        # Padding is masked exactly; only BLAS blocking for other shapes may differ in the ulps.
        assert (torch.tensor(alone[0]) - torch.tensor(batched[index])).abs().max() < 1e-6


def test_long_input_is_truncated_to_the_model_max_length(minilm, reference_bert):
    vectors, counts = minilm.embed(["word " * 1000])
    assert minilm.max_length == 256  # sentence_bert_config.json's max_seq_length
    assert counts == [256]
    token_ids = minilm.tokenizer.encode("word " * 1000).ids
    assert token_ids[-1] == minilm.tokenizer.token_to_id("[SEP]")
    expected = reference_vectors(reference_bert, [token_ids])
    assert (torch.tensor(vectors) - expected).abs().max().item() < 1e-5


def test_token_id_inputs_are_used_as_given(minilm):
    text_vectors, _ = minilm.embed(["a cat sits on the mat."])
    ids = minilm.tokenizer.encode("a cat sits on the mat.").ids
    id_vectors, counts = minilm.embed([ids])
    assert counts == [len(ids)]
    assert (torch.tensor(id_vectors) - torch.tensor(text_vectors)).abs().max() < 1e-6


@pytest.mark.parametrize(
    "bad_inputs, error",
    [([[]], ValueError), ([[10**9]], ValueError), (["text", [1, 2]], TypeError)],
)
def test_bad_inputs_are_refused(minilm, bad_inputs, error):
    with pytest.raises(error):
        minilm.embed(bad_inputs)


def test_pytorch_bin_and_vocab_txt_folder_gives_the_same_vectors(minilm, tmp_path):
    """Older checkpoints ship pytorch_model.bin and only vocab.txt."""
    source = find_packaged_minilm()
    for name in ("config.json", "vocab.txt", "tokenizer_config.json", "sentence_bert_config.json"):
        shutil.copy(source / name, tmp_path / name)
    torch.save(read_weights(source), tmp_path / "pytorch_model.bin")
    legacy = EmbeddingModel.load(tmp_path)
    assert legacy.tokenizer.encode(SENTENCES[3]).ids == minilm.tokenizer.encode(SENTENCES[3]).ids
    legacy_vectors, _ = legacy.embed(SENTENCES)
    vectors, _ = minilm.embed(SENTENCES)
    assert (torch.tensor(legacy_vectors) - torch.tensor(vectors)).abs().max() < 1e-6


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype"):
        EmbeddingModel.load(find_packaged_minilm(), dtype="int3")
