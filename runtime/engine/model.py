"""Llama-family decoder (Llama, Mistral, Qwen2) whose attention reads and writes a paged KV cache.

The batch is flat: one row per token being computed this step, decode tokens first, then each
prefill chunk's tokens. Numerics follow transformers (RMSNorm in float32, rotary tables in
float32 then cast, SDPA attention) so fp32 greedy output matches `generate` token for token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from runtime.engine.config import ModelConfig, RopeConfig

if TYPE_CHECKING:
    from runtime.engine.plan import ExecutionPlan


@dataclass
class PrefillAttention:
    """One prefill chunk: rows [q_start, q_end) of the batch, positions start.. of its sequence."""

    q_start: int
    q_end: int
    context_blocks: torch.Tensor | None  # block ids to read keys from; None = chunk only
    mask: torch.Tensor | None  # [chunk, context] bool; None = plain causal over the chunk
    # Read in place by the compiled prefill kernel instead (model_runner._prefill_metadata);
    # then the two above are unused.
    paged: PagedPrefill | None = None


@dataclass
class DecodeGroup:
    """Decode rows [start, end) whose contexts are gathered together, padded to the longest."""

    start: int
    end: int
    blocks: torch.Tensor  # [(end - start) * max_blocks] block tables, padded
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool


@dataclass
class PagedDecode:
    """All decode rows at once, read in place from their blocks by a compiled kernel."""

    kernel: Callable[..., torch.Tensor]  # kernels.CpuKernels.paged_attention
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [num_decodes] int32
    window: int | None  # sliding window, None for full attention


@dataclass
class PagedPrefill:
    """A prefill chunk read in place from its sequence's blocks by a compiled kernel, its own
    keys and values included (they are stored before attention)."""

    kernel: Callable[..., torch.Tensor]  # kernels.CpuKernels.paged_prefill_attention
    block_table: torch.Tensor  # [blocks up to the chunk's end] int32
    start: int  # the chunk's first position
    window: int | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat cache slot written by each row
    num_decodes: int = 0
    # Decodes go either to the kernel (paged_decode) or, on the torch path, come sorted by
    # context length and split into groups of similar length, so that a short context is
    # not padded to the longest one in the batch.
    paged_decode: PagedDecode | None = None
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillAttention] = field(default_factory=list)
    # The dtype prefill chunks are attended in by SDPA; None: q's
    # (ExecutionPlan.prefill_attention_dtype).
    prefill_dtype: torch.dtype | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """This step's tables on `device` (built on the CPU; the torch path's only: the
        compiled kernels' paged tables stay on the CPU they run on)."""
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device, non_blocking=True)

        return AttentionMetadata(
            slot_mapping=move(self.slot_mapping),
            num_decodes=self.num_decodes,
            paged_decode=self.paged_decode,
            decode_groups=[DecodeGroup(g.start, g.end, move(g.blocks), move(g.mask))
                           for g in self.decode_groups],
            prefills=[PrefillAttention(p.q_start, p.q_end, move(p.context_blocks), move(p.mask), p.paged)
                      for p in self.prefills],
            prefill_dtype=self.prefill_dtype,
        )


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

    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_len, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [len(positions), head_dim], contiguous."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def padded_rows(rows: int) -> int:
    """The row count a oneDNN GEMM runs with: exact up to 32, then 4 sizes per doubling.

    oneDNN builds (JIT-compiles) a kernel per input shape, ~0.5-1 ms each, and caches 1,024.
    A step's row count can be anything up to the token budget, so with exact shapes a busy
    server would keep several thousand kernels (hundreds of MB) or rebuild them all the time.
    Rounding up wastes under a quarter of a GEMM's rows and leaves 48 shapes up to 512 rows.
    """
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class Linear:
    """`x @ weight^T + bias`, with the weight packed once into oneDNN's blocked layout.

    oneDNN with a weight reordered ahead of time is several times faster than `F.linear`
    (MKL) for a step's few rows; results differ from MKL's only in summation order.

    `backend` (ExecutionPlan.linear_backend): "onednn" packs or fails; "torch" uses F.linear,
    or with `transposed_fallback` `torch.mm` over W^T, which beats F.linear for a
    vocabulary-sized weight and few rows.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        backend: str,
        transposed_fallback: bool = False,
    ):
        if backend not in ("onednn", "torch"):
            raise ValueError(f"linear backend must be onednn or torch, not {backend!r}")
        self.bias = bias
        self.dtype = weight.dtype
        self.packed = self.weight_t = self.weight = None
        if backend == "onednn":
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
            except (RuntimeError, AttributeError) as error:
                raise ValueError(f"oneDNN cannot run a {weight.dtype} linear here: {error}") \
                    from error
            return
        if transposed_fallback and bias is None:
            self.weight_t = weight.t().contiguous()
        else:
            self.weight = weight

    @property
    def backend(self) -> str:
        return "onednn" if self.packed is not None else "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x in any float dtype; it is multiplied in the weight's dtype and returned in its own
        (bf16 weights with float32 activations: ExecutionPlan.activation_dtype)."""
        if x.dtype != self.dtype:
            return self._multiply(x.to(self.dtype)).to(x.dtype)
        return self._multiply(x)

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = x.shape[0]
            padding = padded_rows(rows) - rows
            if padding:
                x = F.pad(x, (0, 0, 0, padding))
            out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out[:rows] if padding else out
        if self.weight_t is not None:
            return torch.mm(x, self.weight_t)
        return F.linear(x, self.weight, self.bias)


class TorchOps:
    """The element-wise work between a layer's matmuls, in torch ops (any dtype).

    kernels.CpuKernels has the same three methods, fused in C (float32 only); the forward pass
    calls whichever the plan holds (ExecutionPlan.kernels).
    """

    def __init__(self, config: ModelConfig):
        self.kv_heads, self.head_dim = config.num_kv_heads, config.head_dim

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden += delta (the residual, in place; skipped for None); RMSNorm(hidden) * weight."""
        if delta is not None:
            hidden += delta
        return rms_norm(hidden, weight, eps)

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary embedding on q and k of [q | k | v] rows; k and v stored in their cache slots."""
        tokens, kv_heads, head_dim = qkv.shape[0], self.kv_heads, self.head_dim
        q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q.view(tokens, num_heads, head_dim)
        k = k.view(tokens, kv_heads, head_dim)
        v = v.view(tokens, kv_heads, head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class DecoderLayer:
    def __init__(
        self,
        state: dict[str, torch.Tensor],
        prefix: str,
        config: ModelConfig,
        backend: str,
        dtype: torch.dtype,
    ):
        attn = f"{prefix}.self_attn"
        self.input_norm = state[f"{prefix}.input_layernorm.weight"].to(dtype)
        self.post_attention_norm = state[f"{prefix}.post_attention_layernorm.weight"].to(dtype)
        # Fused projections: one matmul for q/k/v and one for gate/up.
        self.qkv_proj = Linear(
            torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
            torch.cat([state[f"{attn}.{p}_proj.bias"] for p in "qkv"]) if config.qkv_bias else None,
            backend=backend,
        )
        self.o_proj = Linear(state[f"{attn}.o_proj.weight"], backend=backend)
        self.gate_up_proj = Linear(
            torch.cat(
                [state[f"{prefix}.mlp.gate_proj.weight"], state[f"{prefix}.mlp.up_proj.weight"]]
            ),
            backend=backend,
        )
        self.down_proj = Linear(state[f"{prefix}.mlp.down_proj.weight"], backend=backend)


class CausalLM:
    def __init__(
        self,
        config: ModelConfig,
        state: dict[str, torch.Tensor],
        max_len: int,
        plan: ExecutionPlan,
    ):
        """Activations (the residual stream, norms, rotary, attention) in
        plan.activation_dtype; the matmul weights keep the dtype `state` holds them in, on the
        device `state` holds them on (plan.device)."""
        self.config = config
        self.dtype = dtype = plan.activation_dtype
        linear_backend = plan.linear_backend
        # The compiled kernels have TorchOps' three methods, in C.
        self.ops = plan.kernels or TorchOps(config)
        self.layers = [
            DecoderLayer(state, f"model.layers.{i}", config, linear_backend, dtype)
            for i in range(config.num_layers)
        ]
        self.norm = state["model.norm.weight"].to(dtype)
        self.embed_tokens = state["model.embed_tokens.weight"].to(dtype)
        tied = config.tie_word_embeddings or "lm_head.weight" not in state
        head = state["model.embed_tokens.weight" if tied else "lm_head.weight"]
        # With tied embeddings and oneDNN, the packed head is a second copy of the embedding
        # table (vocab x hidden): the lookup needs plain rows, the GEMM the blocked layout.
        self.lm_head = Linear(head, backend=linear_backend, transposed_fallback=True)
        if tied and self.lm_head.weight_t is not None and self.lm_head.dtype == dtype:
            # The torch fallback's W^T holds the same numbers: look rows up through a strided
            # view of it rather than keeping the table twice.
            self.embed_tokens = self.lm_head.weight_t.t()
        self.rotary = RotaryTables(config.rope, config.head_dim, max_len, dtype, plan.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        tokens = input_ids.shape[0]
        cos, sin = self.rotary.lookup(positions)
        hidden = F.embedding(input_ids, self.embed_tokens)  # the residual stream, added in place
        delta = None  # the last MLP's output, added to the residual by the next norm
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = ops.add_rms_norm(hidden, delta, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = ops.rope_store_kv(layer.qkv_proj(x), cos, sin, meta.slot_mapping,
                                        k_cache, v_cache, cfg.num_heads)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            x = ops.add_rms_norm(hidden, layer.o_proj(attn.reshape(tokens, self.q_size)),
                                 layer.post_attention_norm, cfg.rms_norm_eps)
            delta = layer.down_proj(ops.silu_mul(layer.gate_up_proj(x)))
        if delta is not None:
            hidden += delta
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Attend each row to its sequence's context (this step's k/v already in their slots).

    Caches are [num_blocks, block_size, kv_heads, head_dim], in q's dtype or another
    (ExecutionPlan.kv_cache_dtype): what is read from them is converted to q's, or for prefill
    chunks to meta.prefill_dtype, the result back to q's. Decodes are read in place by the
    compiled kernel when the plan has one; otherwise, like prefill chunks with context, whole
    blocks at a time (one index_select per decode group, several times faster than advanced
    indexing on CPU) with the positions past each sequence's length masked out.
    """
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    out = torch.empty_like(q)
    prefill_dtype = meta.prefill_dtype or q.dtype
    if (paged := meta.paged_decode) is not None:
        n = meta.num_decodes
        paged.kernel(q[:n], k_cache, v_cache, paged.block_tables, paged.context_lens, out[:n],
                     paged.window)
    for group in meta.decode_groups:
        n = group.end - group.start
        keys = k_cache.index_select(0, group.blocks).view(n, -1, kv_heads, head_dim)
        values = v_cache.index_select(0, group.blocks).view(n, -1, kv_heads, head_dim)
        keys, values = keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype)
        # The query heads that share a KV head go as that head's rows ([n, kv_heads, group, d]), so
        # no backend copies the keys and values once per query head (SDPA's enable_gqa may).
        queries = q[group.start : group.end].reshape(n, kv_heads, -1, head_dim)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask)
        out[group.start : group.end] = o.view(n, -1, head_dim)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_end)
        if (paged := chunk.paged) is not None:
            paged.kernel(q[rows], k_cache, v_cache, paged.block_table, paged.start, out[rows],
                         paged.window)
            continue
        query = q[rows].transpose(0, 1).unsqueeze(0).to(prefill_dtype)
        if chunk.context_blocks is None:
            keys = k[rows].transpose(0, 1).unsqueeze(0).to(prefill_dtype)
            values = v[rows].transpose(0, 1).unsqueeze(0).to(prefill_dtype)
        else:
            keys = k_cache.index_select(0, chunk.context_blocks).view(-1, kv_heads, head_dim)
            values = v_cache.index_select(0, chunk.context_blocks).view(-1, kv_heads, head_dim)
            keys = keys.transpose(0, 1).unsqueeze(0).to(prefill_dtype)
            values = values.transpose(0, 1).unsqueeze(0).to(prefill_dtype)
        o = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)  # back in q's dtype
    return out
