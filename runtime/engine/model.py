"""Llama-family decoder (Llama, Mistral, Qwen2) whose attention reads and writes a paged KV cache.

The batch is flat: one row per token being computed this step, decode tokens first, then each
prefill chunk's tokens. Numerics follow transformers (RMSNorm in float32, rotary tables in
float32 then cast, SDPA attention) so fp32 greedy output matches `generate` token for token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.engine.config import ModelConfig, RopeConfig


@dataclass
class PrefillAttention:
    """One prefill chunk: rows [q_start, q_end) of the batch, positions start.. of its sequence."""

    q_start: int
    q_end: int
    context_blocks: torch.Tensor | None  # block ids to read keys from; None = chunk only
    mask: torch.Tensor | None  # [chunk, context] bool; None = plain causal over the chunk


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts are gathered together, padded to the longest."""

    start: int
    end: int
    blocks: torch.Tensor  # [(end - start) * max_blocks] block tables, padded
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat cache slot written by each row
    num_decodes: int = 0
    # Decode rows come sorted by context length and split into groups of similar length, so
    # a short context is not padded to the longest one in the batch.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillAttention] = field(default_factory=list)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryTables:
    """cos/sin for every position up to max_len, computed once in float32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype):
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        return cos, self.sin.index_select(0, positions).unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer:
    def __init__(self, state: dict[str, torch.Tensor], prefix: str, config: ModelConfig):
        attn = f"{prefix}.self_attn"
        self.input_norm = state[f"{prefix}.input_layernorm.weight"]
        self.post_attention_norm = state[f"{prefix}.post_attention_layernorm.weight"]
        # Fused projections: one matmul for q/k/v and one for gate/up.
        self.qkv_weight = torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        self.qkv_bias = (
            torch.cat([state[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if config.qkv_bias else None
        )
        self.o_weight = state[f"{attn}.o_proj.weight"]
        self.gate_up_weight = torch.cat(
            [state[f"{prefix}.mlp.gate_proj.weight"], state[f"{prefix}.mlp.up_proj.weight"]]
        )
        self.down_weight = state[f"{prefix}.mlp.down_proj.weight"]


class CausalLM:
    def __init__(
        self, config: ModelConfig, state: dict[str, torch.Tensor], max_len: int, dtype: torch.dtype
    ):
        self.config = config
        self.dtype = dtype
        self.layers = [
            DecoderLayer(state, f"model.layers.{i}", config) for i in range(config.num_layers)
        ]
        self.norm = state["model.norm.weight"]
        # The LM head is kept transposed ([hidden, vocab], contiguous): on CPU `x @ W^T` with W
        # stored that way runs about 2x faster than F.linear for the few rows of a decode step
        # (a vocabulary-sized GEMV), and never slower for more. Tied embeddings read their
        # rows from the same tensor (a strided view), so the weights are not held twice.
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        head = state["model.embed_tokens.weight"] if tied else state["lm_head.weight"]
        self.lm_head_t = head.t().contiguous()
        self.embed_tokens = self.lm_head_t.t() if tied else state["model.embed_tokens.weight"]
        self.rotary = RotaryTables(config.rope, config.head_dim, max_len, dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        cfg = self.config
        tokens = input_ids.shape[0]
        cos, sin = self.rotary.lookup(positions)
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(tokens, cfg.num_heads, cfg.head_dim)
            k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            hidden = hidden + F.linear(attn.reshape(tokens, self.q_size), layer.o_weight)
            x = rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up_weight).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer.down_weight)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return torch.mm(x, self.lm_head_t).float()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Store this step's k/v in their slots, then attend each row to its sequence's context.

    Caches are [num_blocks, block_size, kv_heads, head_dim]; context is read whole blocks at a
    time (one index_select per decode group, several times faster than advanced indexing on
    CPU) and the positions past each sequence's length are masked out.
    """
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        n = group.end - group.start
        keys = k_cache.index_select(0, group.blocks).view(n, -1, kv_heads, head_dim)
        values = v_cache.index_select(0, group.blocks).view(n, -1, kv_heads, head_dim)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[group.start : group.end].unsqueeze(2), keys, values, attn_mask=group.mask,
            enable_gqa=True,
        )
        out[group.start : group.end] = o.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        if chunk.context_blocks is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
        else:
            keys = k_cache.index_select(0, chunk.context_blocks).view(-1, kv_heads, head_dim)
            values = v_cache.index_select(0, chunk.context_blocks).view(-1, kv_heads, head_dim)
            keys = keys.transpose(0, 1).unsqueeze(0)
            values = values.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out
