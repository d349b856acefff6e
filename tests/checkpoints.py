"""Tiny random HF-format checkpoints that tests build for themselves (no model hub here).

Shared by the registry, engine and server tests. Builders are plain functions; the session-scoped
fixtures in tests/conftest.py cache what they build.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TRAINING_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for engine tests.",
    "Service level objectives keep latency honest: p50, p90, p99.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill chunks with decode steps.",
    "Grüße aus Köln — naïve café, 東京 and emoji 🙂 are multi-byte.",
]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(directory: Path, vocab_size: int = 300, chat_template: str | None = None):
    """Write tokenizer.json + tokenizer_config.json; return the tokenizer's vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_SENTENCES, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 2048,
    }
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tokenizer.get_vocab_size()


def save_random_model(config, directory: Path, seed: int = 0, dtype=torch.float32) -> None:
    """Random weights for `config` saved as safetensors (the HF class picks the layout)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.eval()
    model.save_pretrained(str(directory), safe_serialization=True)


def tiny_config(kind: str = "llama", **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    base.update(overrides)
    return classes[kind](**base)
