"""`inferops demo-model`: a deterministic checkpoint that transformers loads and runs."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from runtime.engine.demo_model import PRESETS, add_arguments, build_demo_tokenizer, main, write_demo_model

torch.set_num_threads(2)

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def file_digests(directory) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "tiny", preset="tiny", seed=7)


def test_writes_the_hf_file_set_with_tiny_shapes(demo_dir):
    assert {path.name for path in demo_dir.iterdir()} == EXPECTED_FILES
    assert all(path.stat().st_mode & 0o444 == 0o444 for path in demo_dir.iterdir())
    config = json.loads((demo_dir / "config.json").read_text())
    tiny = PRESETS["tiny"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == tiny.hidden_size == 256
    assert config["num_hidden_layers"] == 4
    assert config["num_key_value_heads"] == tiny.num_key_value_heads
    assert config["vocab_size"] == 30522
    assert config["max_position_embeddings"] == 2048
    tokenizer_config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<s>" and tokenizer_config["eos_token"] == "</s>"
    assert "chat_template" in tokenizer_config


def test_same_seed_gives_byte_identical_files(demo_dir, tmp_path):
    again = write_demo_model(tmp_path / "again", preset="tiny", seed=7)
    other_seed = write_demo_model(tmp_path / "other", preset="tiny", seed=8)
    assert file_digests(again) == file_digests(demo_dir)
    assert (
        file_digests(other_seed)["model.safetensors"] != file_digests(demo_dir)["model.safetensors"]
    )
    assert file_digests(other_seed)["tokenizer.json"] == file_digests(demo_dir)["tokenizer.json"]


def test_loads_and_generates_with_transformers(demo_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_dir).eval()
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert 9_000_000 < parameters < 14_000_000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How fast is the replica?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert prompt[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(prompt[:2]) == ["<s>", "<|user|>"]
    assert tokenizer.convert_ids_to_tokens(prompt[-1:]) == ["<|assistant|>"]
    output = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    assert output.shape == (1, len(prompt) + 5)


def test_tokenizer_round_trips_lower_case_english_also_when_streamed():
    from tokenizers.decoders import DecodeStream

    tokenizer = build_demo_tokenizer()
    text = "the replica is slow again), is it? we serve 42 requests: 97% of them fast; fine!"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id("<s>")
    assert "<unk>" not in encoding.tokens
    assert tokenizer.decode(encoding.ids) == text
    stream = DecodeStream(skip_special_tokens=True)
    assert "".join(stream.step(tokenizer, i) or "" for i in encoding.ids) == text
    # Chat markers are single tokens even inside text.
    assert tokenizer.encode("<|user|> hi", add_special_tokens=False).tokens == ["<|user|>", "hi"]


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        write_demo_model(tmp_path, preset="huge")


def test_cli_main_reports_parameter_count(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args([str(tmp_path / "cli"), "--seed", "1"])) == 0
    assert "10,715,904 parameters" in capsys.readouterr().out


def test_a_bf16_checkpoint_from_a_copied_vocabulary(tmp_path, capsys):
    """What the GPU check does on a machine without the MiniLM package (bench/gpu/)."""
    import argparse
    import shutil

    from safetensors import safe_open

    from runtime.engine.encoder import find_packaged_minilm

    vocab = tmp_path / "vocab.txt"
    shutil.copy(find_packaged_minilm() / "vocab.txt", vocab)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "bf16"
    assert main(parser.parse_args([str(out), "--dtype", "bfloat16", "--vocab", str(vocab)])) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}
    assert (out / "tokenizer.json").read_bytes() == (write_demo_model(tmp_path / "f32") / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="dtype='float16'"):
        write_demo_model(tmp_path / "x", dtype="float16")


def test_the_1b_preset_has_about_a_billion_parameters():
    preset, vocab = PRESETS["1b"], 30522
    hidden = preset.hidden_size
    kv_width = preset.num_key_value_heads * hidden // preset.num_attention_heads
    per_layer = hidden * (2 * hidden + 2 * kv_width) + 3 * hidden * preset.intermediate_size + 2 * hidden
    parameters = vocab * hidden + preset.num_hidden_layers * per_layer + hidden  # tied embeddings
    assert 1.0e9 < parameters < 1.1e9 and hidden // preset.num_attention_heads == 64


def test_training_on_the_corpus_lowers_the_loss_reproducibly():
    """Exercised on a one-layer, 32-wide model: the loop is the same, the cost is not."""
    from transformers import LlamaForCausalLM

    from runtime.engine.demo_model import (
        CORPUS_DIR,
        DemoPreset,
        build_llama_config,
        initialise_weights,
        train_on_corpus,
    )

    assert sum(path.stat().st_size for path in CORPUS_DIR.glob("*.txt")) > 100_000
    tokenizer = build_demo_tokenizer()
    config = build_llama_config(DemoPreset(32, 64, 1, 2, 1), tokenizer)
    trained_states, losses = [], []
    for _ in range(2):
        model = LlamaForCausalLM(config)
        initialise_weights(model, seed=3)
        losses.append(train_on_corpus(model, tokenizer, steps=6, seed=3, seq_len=32, batch_size=4))
        trained_states.append(model.state_dict())
    untrained = LlamaForCausalLM(config)
    initialise_weights(untrained, seed=3)
    # ln(30522) ~ 10.33 is the loss of a uniform guess; six steps already beat it.
    assert losses[0] == losses[1] < 10.2
    for name, tensor in trained_states[0].items():
        assert torch.equal(tensor, trained_states[1][name])
    assert not torch.equal(
        trained_states[0]["model.layers.0.mlp.up_proj.weight"],
        untrained.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
