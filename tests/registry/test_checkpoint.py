"""Facts and digests read from real (tiny) HF checkpoints, and every way a checkpoint is refused."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from registry import checkpoint
from registry.checkpoint import CheckpointError


def copy_checkpoint(source, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def test_llama_facts_match_config(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    facts = checkpoint.read_facts(tiny_llama_dir, task="generate")
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert facts.architecture == "LlamaForCausalLM"
    assert facts.parameter_count == sum(p.numel() for p in model.parameters())
    assert (facts.hidden_size, facts.num_layers) == (config["hidden_size"], config["num_hidden_layers"])
    assert (facts.num_attention_heads, facts.num_kv_heads) == (4, 2)
    assert facts.head_dim == 64 // 4
    assert facts.vocab_size == config["vocab_size"]
    assert facts.max_context == config["max_position_embeddings"]
    assert facts.dtype == "float32"
    assert facts.weight_bytes == facts.parameter_count * 4
    assert facts.kv_cache_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert facts.has_tokenizer and facts.has_chat_template


@pytest.mark.parametrize("kind,arch", [("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_other_decoders_and_mqa(checkpoint_factory, kind, arch):
    directory = checkpoint_factory(f"facts-{kind}", kind, num_key_value_heads=1, tie_word_embeddings=True)
    facts = checkpoint.read_facts(directory, task="generate")
    assert facts.architecture == arch
    assert facts.num_kv_heads == 1
    assert facts.kv_cache_bytes_per_token == 2 * 2 * 1 * 16 * 4


def test_bf16_weights_change_dtype_and_kv_bytes(checkpoint_factory):
    import torch

    directory = checkpoint_factory("facts-bf16", "llama", dtype=torch.bfloat16, torch_dtype="bfloat16")
    facts = checkpoint.read_facts(directory)
    assert facts.dtype == "bfloat16"
    assert facts.weight_bytes == facts.parameter_count * 2
    assert facts.kv_cache_bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_digest_is_stable_and_sensitive(tiny_llama_dir, tmp_path):
    copy = copy_checkpoint(tiny_llama_dir, tmp_path)
    first = checkpoint.manifest_digest(checkpoint.artifact_manifest(copy))
    assert first == checkpoint.manifest_digest(checkpoint.artifact_manifest(tiny_llama_dir))
    (copy / "generation_config.json").write_text("{}")
    assert checkpoint.manifest_digest(checkpoint.artifact_manifest(copy)) != first
    manifest = checkpoint.artifact_manifest(copy)
    assert [entry["path"] for entry in manifest] == sorted(entry["path"] for entry in manifest)


def test_file_uri_and_paths(tiny_llama_dir):
    assert checkpoint.artifact_path(f"file://{tiny_llama_dir}") == tiny_llama_dir
    assert checkpoint.artifact_path(str(tiny_llama_dir)) == tiny_llama_dir


@pytest.mark.parametrize("uri,fragment", [
    ("s3://bucket/model", "s3:// cannot be validated"),
    ("hf://org/model", "hf:// cannot be validated"),
    ("relative/dir", "must be an absolute path"),
    ("/definitely/not/here", "no such directory"),
    ("", "empty"),
    ("file://otherhost/x", "not local"),
])
def test_refused_uris(uri, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        checkpoint.artifact_path(uri)


def test_path_that_is_a_file(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="is a file"):
        checkpoint.artifact_path(str(tiny_llama_dir / "config.json"))


def broken(tiny_llama_dir, tmp_path, mutate):
    copy = copy_checkpoint(tiny_llama_dir, tmp_path)
    mutate(copy)
    return copy


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: (d / "config.json").unlink(), "no config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "JSON object"),
    (lambda d: (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
     "unsupported architecture 'GPT2LMHeadModel'"),
    (lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 8})), "architectures"),
    (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
])
def test_bad_checkpoints(tiny_llama_dir, tmp_path, mutate, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        checkpoint.read_facts(broken(tiny_llama_dir, tmp_path, mutate))


def test_truncated_safetensors(tiny_llama_dir, tmp_path):
    def truncate(directory):
        path = directory / "model.safetensors"
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        checkpoint.read_facts(broken(tiny_llama_dir, tmp_path, truncate))


def test_header_longer_than_file(tiny_llama_dir, tmp_path):
    def lie(directory):
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", 10_000) + b"{}")

    with pytest.raises(CheckpointError, match="header claims 10000 bytes"):
        checkpoint.read_facts(broken(tiny_llama_dir, tmp_path, lie))


def test_header_not_json(tiny_llama_dir, tmp_path):
    def garble(directory):
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{x")

    with pytest.raises(CheckpointError, match="unreadable safetensors header"):
        checkpoint.read_facts(broken(tiny_llama_dir, tmp_path, garble))


def test_task_must_fit_architecture(tiny_llama_dir):
    with pytest.raises(CheckpointError, match="task 'generate'"):
        checkpoint.read_facts(tiny_llama_dir, task="embed")
