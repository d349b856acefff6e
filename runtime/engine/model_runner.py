"""All tensor work of a step: the KV cache pool, batch inputs, the forward pass, logits."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging

import numpy as np
import torch

from runtime.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, ModelConfig, parse_device
from runtime.engine.cuda_graphs import DecodeGraphs, DecodeInputs
from runtime.engine.loader import load_state_dict
from runtime.engine.model import (
    AttentionMetadata,
    CausalLM,
    DecodeGroup,
    PagedDecode,
    PagedPrefill,
    PrefillAttention,
)
from runtime.engine.plan import ExecutionPlan
from runtime.engine.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)

# What one more decode group costs per layer (two gathers and an SDPA call), in blocks of
# context per sequence: measured on CPU, see _decode_groups. On a GPU a group costs kernel
# launches (tens of microseconds) against nanoseconds per gathered block: estimated, not measured.
GROUP_OVERHEAD_BLOCKS = 32
GPU_GROUP_OVERHEAD_BLOCKS = 1024


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype_bytes


def num_kv_blocks_for(
    config: EngineConfig, model: ModelConfig, max_model_len: int, dtype: torch.dtype
) -> int | None:
    """The KV blocks `config` asks for; None on a GPU where it names no size, for the runner to
    size the cache from the memory the weights and a profiled step leave (gpu_kv_blocks)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory is None and parse_device(config.device)[0] == "cuda":
        return None
    per_block = kv_bytes_per_block(model, config.block_size, dtype)
    if config.kv_cache_memory is not None:
        blocks = config.kv_cache_memory // per_block
    else:
        blocks_per_seq = -(-max_model_len // config.block_size)
        blocks = min(DEFAULT_KV_CACHE_MEMORY // per_block, config.max_num_seqs * blocks_per_seq)
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory={config.kv_cache_memory} bytes holds no block of {per_block} bytes"
        )
    return int(blocks)


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# A step's large intermediates (hundreds of MB of tensors of several MB each for a long step)
# come back step after step. With glibc's defaults, blocks above its mmap threshold (dynamic,
# at most 32 MiB) are fresh mappings and freed heap tops go back to the OS, so every such step
# pays a page fault per 4 KiB of them. Serving them from the heap and keeping up to a GiB of
# freed memory makes later steps reuse the same pages.
MALLOC_TRIM_THRESHOLD_BYTES = 1 << 30
MALLOC_MMAP_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory_for_reuse() -> bool:
    """Tune glibc malloc for a process that allocates and frees the same large tensors every
    step (what tcmalloc or jemalloc would do, without preloading one). Process-wide, like the
    thread count; a no-op (False) where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES)
    )


def gpu_kv_blocks(total: int, used: int, activation_peak: int, utilization: float,
                  per_block: int) -> int:
    """KV blocks that fit in `utilization` of a GPU's `total` bytes once what is `used` now (the
    weights, the CUDA context, other processes) and a step's `activation_peak` are set aside;
    ValueError with the figures where none does."""
    available = int(total * utilization) - used - activation_peak
    if available < per_block:
        gib = 2**30
        raise ValueError(
            f"no room for the KV cache: {utilization:g} of the GPU's {total / gib:.1f} GiB is "
            f"{total * utilization / gib:.1f} GiB, and {used / gib:.1f} GiB are in use (weights, CUDA "
            f"context, other processes) with {activation_peak / gib:.2f} GiB more at a step's peak. "
            "Raise --gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or "
            "serve a smaller model.")
    return available // per_block


def decode_inputs(decodes: list[ScheduledChunk], block_size: int) -> DecodeInputs:
    """A decode-only step's inputs as arrays, in `decodes` order (a CUDA graph's static buffers)."""
    bs = block_size
    lengths = np.array([c.end for c in decodes], dtype=np.int64)
    tables = [c.seq.block_table[: -(-c.end // bs)] for c in decodes]
    block_tables = np.zeros((len(tables), max(map(len, tables))), dtype=np.int64)
    for row, table in zip(block_tables, tables, strict=True):
        row[: len(table)] = table
    positions = lengths - 1
    return DecodeInputs(
        token_ids=np.array([c.seq.token_ids[c.start] for c in decodes], dtype=np.int64),
        positions=positions,
        slots=block_tables[np.arange(len(decodes)), positions // bs] * bs + positions % bs,
        block_tables=block_tables,
        context_lens=lengths,
    )


def long_tensor(values: list[int]) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long) through numpy, which converts a list of a
    step's 2,048 ints 3.5x faster (160 vs 550 us)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        plan: ExecutionPlan,
        max_model_len: int,
        num_blocks: int | None,
    ):
        """`num_blocks` None (a GPU): as many as gpu_memory_utilization leaves (gpu_kv_blocks)."""
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # process-wide: the engine owns the CPU
        if not keep_freed_memory_for_reuse():
            logger.info("not glibc: malloc left as it is")
        self.block_size = config.block_size
        self.plan = plan
        self.device = plan.device
        self.on_gpu = plan.device.type == "cuda"
        if self.on_gpu:
            torch.cuda.set_device(self.device)
        self.group_overhead_blocks = GPU_GROUP_OVERHEAD_BLOCKS if self.on_gpu else GROUP_OVERHEAD_BLOCKS
        state = load_state_dict(config.model, plan.weight_dtype, plan.device)
        self.model = CausalLM(model_config, state, max_model_len, plan)
        del state  # the layers hold what they need (packed copies, with oneDNN)
        self.sliding_window = model_config.sliding_window
        self.model_config = model_config
        if num_blocks is None:
            num_blocks = self._profile_kv_blocks(config, max_model_len)
        self.num_blocks = num_blocks
        self.graphs: DecodeGraphs | None = None
        if self.on_gpu and not config.enforce_eager:
            # One block more than the block manager hands out: padding rows of a graph write there.
            self.kv_caches = self._kv_caches(num_blocks + 1)
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, block_size=self.block_size, max_num_seqs=config.max_num_seqs,
                max_model_len=max_model_len, sliding_window=self.sliding_window, spare_block=num_blocks,
                device=self.device)
            if not self.graphs.capture():
                self.graphs = None
        else:
            self.kv_caches = self._kv_caches(num_blocks)

    def _kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        kv_dtype = self.plan.kv_cache_dtype
        return [(torch.zeros(shape, dtype=kv_dtype, device=self.device),
                 torch.zeros(shape, dtype=kv_dtype, device=self.device))
                for _ in range(cfg.num_layers)]

    @torch.inference_mode()
    def _profile_kv_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        """Run the largest step the scheduler can make (a fresh prefill of the whole token
        budget, logits for max_num_seqs rows) to find the activations' peak, as vLLM does, then
        give the KV cache what gpu_memory_utilization leaves."""
        tokens = min(config.max_num_batched_tokens, max_model_len)
        blocks = -(-tokens // self.block_size)
        scratch = self._kv_caches(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        positions = torch.arange(tokens, device=self.device)
        meta = AttentionMetadata(slot_mapping=positions,
                                 prefills=[PrefillAttention(0, tokens, context_blocks=None, mask=None)])
        hidden = self.model.forward(torch.zeros(tokens, dtype=torch.long, device=self.device),
                                    positions, meta, scratch)
        rows = min(config.max_num_seqs, tokens)
        self.model.compute_logits(hidden[-rows:]).softmax(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden, positions, meta
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.plan.kv_cache_dtype)
        num_blocks = gpu_kv_blocks(total, total - free, peak, config.gpu_memory_utilization, per_block)
        logger.info("GPU memory: %.1f GiB total, %.1f GiB in use after loading, a step peaks at "
                    "%.2f GiB more; %d KV blocks fit in %g of it", total / 2**30, (total - free) / 2**30,
                    peak / 2**30, num_blocks, config.gpu_memory_utilization)
        return num_blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every scheduled chunk; return the logits [chunks that complete their sequence,
        vocab] in `out.chunks` order, and the hidden states of every token of each prefill
        chunk whose sequence needs prompt logits, in `out.prefills` order (no rows when none
        does). Those are left to `prompt_logits`, a slice at a time: a 2,048-token chunk's
        logits over a 152k vocabulary would take 1.2 GB at once.

        On a GPU it returns once the step has run, so that the scheduler times the step itself
        rather than its kernel launches."""
        logits, prompt_hidden = self._execute(out)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return logits, prompt_hidden

    def _execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphs is not None and out.decodes and not out.prefills:
            logits = self._replay_decode(out.decodes)
            if logits is not None:
                return logits, logits[:0]
        input_ids, positions, meta, sample_rows, prompt_rows = self.prepare(out)
        if self.on_gpu:
            input_ids, positions, sample_rows, prompt_rows = (
                t.to(self.device, non_blocking=True) for t in (input_ids, positions, sample_rows, prompt_rows))
            meta = meta.to(self.device)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        return self.model.compute_logits(hidden[sample_rows]), hidden[prompt_rows]

    def _replay_decode(self, decodes: list[ScheduledChunk]) -> torch.Tensor | None:
        """A decode-only step through a CUDA graph (cuda_graphs.py); None where none fits it."""
        inputs = decode_inputs(decodes, self.block_size)
        key = self.graphs.key_for(len(decodes), inputs.block_tables.shape[1])
        return None if key is None else self.graphs.run(key, inputs)

    def sampling_device(self) -> contextlib.AbstractContextManager:
        """Where what reads the logits (processors, sampler, logprobs) makes its tensors: the
        logits' device. A no-op on the CPU, where a device mode would only add overhead to
        every torch call."""
        return torch.device(self.device) if self.on_gpu else contextlib.nullcontext()

    @torch.inference_mode()
    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def prepare(self, out: SchedulerOutput):
        bs = self.block_size
        # Decode rows go longest context first, so that groups of similar length are
        # contiguous rows (see _decode_groups); sample_rows maps them back to chunk order.
        decodes = sorted(out.decodes, key=lambda c: c.end, reverse=True)
        row_of = {id(chunk): row for row, chunk in enumerate(decodes)}
        sample_rows = [row_of[id(chunk)] for chunk in out.decodes]
        token_ids = [chunk.seq.token_ids[chunk.start] for chunk in decodes]
        decode_positions = [chunk.start for chunk in decodes]
        position_parts = [np.array(decode_positions, dtype=np.int64)]
        slot_parts = [np.array(
            [c.seq.block_table[c.start // bs] * bs + c.start % bs for c in decodes], dtype=np.int64
        )]
        prefill_rows: list[tuple[ScheduledChunk, int]] = []
        for chunk in out.prefills:
            seq = chunk.seq
            first_row = len(token_ids)
            token_ids.extend(seq.token_ids[chunk.start : chunk.end])
            positions = np.arange(chunk.start, chunk.end, dtype=np.int64)
            first_block = chunk.start // bs
            blocks = np.array(seq.block_table[first_block : (chunk.end - 1) // bs + 1],
                              dtype=np.int64)
            position_parts.append(positions)
            slot_parts.append(blocks[positions // bs - first_block] * bs + positions % bs)
            prefill_rows.append((chunk, first_row))
            if chunk.completes_sequence:
                sample_rows.append(len(token_ids) - 1)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slot_parts)),
                                 prefill_dtype=self.plan.prefill_attention_dtype)
        if decodes:
            meta.num_decodes = len(decodes)
            if self.plan.kernels is not None:
                meta.paged_decode = self._paged_decode(decodes)
            else:
                meta.decode_groups = self._decode_groups(decodes)
        prompt_rows = [row for chunk, first_row in prefill_rows if chunk.seq.needs_prompt_logits
                       for row in range(first_row, first_row + chunk.num_tokens)]
        meta.prefills = [self._prefill_metadata(chunk, row) for chunk, row in prefill_rows]
        return (
            long_tensor(token_ids),
            torch.from_numpy(np.concatenate(position_parts)),
            meta,
            long_tensor(sample_rows),
            long_tensor(prompt_rows),
        )

    def _paged_decode(self, decodes: list[ScheduledChunk]) -> PagedDecode:
        bs = self.block_size
        tables = [c.seq.block_table[: -(-c.end // bs)] for c in decodes]
        block_tables = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for row, table in zip(block_tables, tables, strict=True):
            row[: len(table)] = table
        return PagedDecode(
            self.plan.kernels.paged_attention,
            torch.from_numpy(block_tables),
            torch.from_numpy(np.array([c.end for c in decodes], dtype=np.int32)),
            self.sliding_window,
        )

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[DecodeGroup]:
        """Split decodes (sorted longest first) into groups read with one gather each.

        One gather for the whole batch pads every context to the longest one, so with mixed
        lengths most gathered and attended keys are padding. A group costs a fixed overhead
        per layer (two gathers and an SDPA call), worth about group_overhead_blocks blocks per
        sequence, so a new group starts only where the padding it saves the sequences left
        outweighs that: their count times the difference in blocks.
        """
        bs = self.block_size
        num_blocks = [-(-c.end // bs) for c in decodes]
        groups, start = [], 0
        for i in range(1, len(decodes) + 1):
            if i < len(decodes):
                saved = (num_blocks[start] - num_blocks[i]) * (len(decodes) - i)
                if saved <= self.group_overhead_blocks:
                    continue
            groups.append(self._decode_group(decodes, start, i, num_blocks[start]))
            start = i
        return groups

    def _decode_group(
        self, decodes: list[ScheduledChunk], start: int, end: int, max_blocks: int
    ) -> DecodeGroup:
        bs = self.block_size
        members = decodes[start:end]
        lengths = [c.end for c in members]
        blocks: list[int] = []
        for chunk in members:
            table = chunk.seq.block_table[:max_blocks]
            blocks.extend(table)
            blocks.extend([0] * (max_blocks - len(table)))
        key_positions = torch.arange(max_blocks * bs)
        length_tensor = torch.tensor(lengths).unsqueeze(1)
        allowed = key_positions.unsqueeze(0) < length_tensor
        if self.sliding_window is not None:
            allowed &= key_positions.unsqueeze(0) > length_tensor - 1 - self.sliding_window
        return DecodeGroup(start, end, torch.tensor(blocks, dtype=torch.long),
                           allowed[:, None, None, :])

    def _prefill_metadata(self, chunk: ScheduledChunk, first_row: int) -> PrefillAttention:
        """How a prefill chunk is attended (ExecutionPlan.prefill_attention). "kernel": in
        place, in tiles of rows that read each block of the context once, several times
        faster than SDPA over gathered blocks. "sdpa": over the chunk's own keys for a fresh
        prompt, over its gathered blocks, masked, for a chunk with context."""
        rows = (first_row, first_row + chunk.num_tokens)
        window = self.sliding_window
        bs = self.block_size
        num_blocks = -(-chunk.end // bs)
        if self.plan.prefill_attention == "kernel":
            table = torch.from_numpy(np.array(chunk.seq.block_table[:num_blocks], dtype=np.int32))
            return PrefillAttention(*rows, context_blocks=None, mask=None, paged=PagedPrefill(
                self.plan.kernels.paged_prefill_attention, table, chunk.start, window))
        if chunk.start == 0 and (window is None or chunk.num_tokens <= window):
            return PrefillAttention(*rows, context_blocks=None, mask=None)
        blocks = torch.tensor(chunk.seq.block_table[:num_blocks], dtype=torch.long)
        query_positions = torch.arange(chunk.start, chunk.end).unsqueeze(1)
        key_positions = torch.arange(num_blocks * bs).unsqueeze(0)
        mask = key_positions <= query_positions
        if window is not None:
            mask &= key_positions > query_positions - window
        return PrefillAttention(*rows, context_blocks=blocks, mask=mask)
