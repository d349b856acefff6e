"""CUDA graphs of decode-only steps, as vLLM captures them: a step that only decodes replays a
graph recorded once at start-up instead of launching each layer's kernels from Python.

A graph replays fixed shapes at fixed addresses, so every input lives in a static buffer and
each graph is recorded for a batch size and a context width (in blocks): a step takes the
smallest graph that holds its decodes and its longest context. Rows past the step's decodes
are padding: they read one key of block 0 and write their key and value to a spare block that
no sequence owns, and their logits are never read. Decode attention in a graph is the torch
path (a gather of each row's blocks and a masked SDPA) at the graph's width.

Capture is checked once against the same step run eagerly; a failure or a mismatch turns the
graphs off with a warning, and the engine runs eagerly (--enforce-eager does so from the start).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.engine.model import AttentionMetadata, DecodeGroup

if TYPE_CHECKING:
    from runtime.engine.model import CausalLM

logger = logging.getLogger(__name__)

# vLLM captures 1, 2, 4 and every multiple of 8; fewer sizes here, a third more padding at worst.
BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SMALLEST_WIDTH_BLOCKS = 16


@dataclass(frozen=True)
class DecodeInputs:
    """One decode-only step, a row per sequence (model_runner.decode_inputs)."""

    token_ids: np.ndarray  # [rows] int64
    positions: np.ndarray
    slots: np.ndarray  # the flat cache slot each row's key and value go to
    block_tables: np.ndarray  # [rows, blocks of the longest context]
    context_lens: np.ndarray  # keys each row attends to, its own included

    @classmethod
    def empty(cls) -> DecodeInputs:
        none = np.zeros(0, np.int64)
        return cls(none, none, none, np.zeros((0, 0), np.int64), none)


def capture_sizes(max_num_seqs: int) -> list[int]:
    return sorted({size for size in BATCH_SIZES if size < max_num_seqs} | {max_num_seqs})


def capture_widths(max_blocks: int) -> list[int]:
    """Doubling context widths in blocks, the last one every sequence's full length."""
    widths, width = [], SMALLEST_WIDTH_BLOCKS
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


def smallest_at_least(options: list[int], wanted: int) -> int | None:
    return next((option for option in options if option >= wanted), None)


class CudaRecorder:
    """Records steps as CUDA graphs sharing one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None:
        """One eager run on a side stream before any capture (lazy init, cuBLAS workspaces)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return graph.replay, logits

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class EagerRecorder:
    """Stands in for CudaRecorder where there is no GPU (the tests): a replay runs the step again
    into the recorded output, so everything around the graphs (static buffers, padding, choosing a
    graph, reading its output) runs as it does on a GPU; only the capture itself does not."""

    def warm_up(self, step: Callable[[], torch.Tensor]) -> None:
        step()

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        logits = step()
        return (lambda: logits.copy_(step())), logits

    def synchronize(self) -> None:
        pass


Recorder = CudaRecorder | EagerRecorder


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 block_size: int, max_num_seqs: int, max_model_len: int, sliding_window: int | None,
                 spare_block: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.sliding_window = block_size, sliding_window
        self.sizes = capture_sizes(max_num_seqs)
        self.widths = capture_widths(-(-max_model_len // block_size))
        size, width = self.sizes[-1], self.widths[-1]
        self.spare_slot = spare_block * block_size
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), self.spare_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(size, width, dtype=torch.long, device=device)
        self.context_lens = torch.ones(size, dtype=torch.long, device=device)
        self.key_positions = torch.arange(width * block_size, device=device)
        # (batch size, width) -> (replay, the logits buffer each replay writes)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, recorder: Recorder | None = None) -> bool:
        """Record a graph for every (batch size, width), largest first so that they share one
        memory pool; True when they replay what an eager step computes, else False (logged).
        `recorder`: how a step is recorded (default: as a CUDA graph)."""
        started = time.monotonic()
        recorder = recorder or CudaRecorder()
        try:
            recorder.warm_up(lambda: self.step(self.sizes[-1], self.widths[-1]))
            for width in reversed(self.widths):
                for size in reversed(self.sizes):
                    self.graphs[(size, width)] = recorder.record(functools.partial(self.step, size, width))
            recorder.synchronize()
        except RuntimeError as error:
            logger.warning("CUDA graphs could not be captured (%s); decoding eagerly", error)
            self.graphs.clear()
            return False
        if not self._replays_eager_step():
            logger.warning("a CUDA graph's logits differ from the same step run eagerly; decoding eagerly")
            self.graphs.clear()
            return False
        logger.info("captured %d CUDA graphs of decode steps (batch sizes up to %d, contexts up to %d "
                    "blocks) in %.1f s", len(self.graphs), self.sizes[-1], self.widths[-1],
                    time.monotonic() - started)
        return True

    def step(self, size: int, width: int) -> torch.Tensor:
        """One decode step over the first `size` rows of the buffers, reading `width` blocks."""
        lens = self.context_lens[:size].unsqueeze(1)
        keys = self.key_positions[: width * self.block_size].unsqueeze(0)
        allowed = keys < lens
        if self.sliding_window is not None:
            allowed &= keys > lens - 1 - self.sliding_window
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decodes=size, decode_groups=[
            DecodeGroup(0, size, self.block_tables[:size, :width].reshape(-1), allowed[:, None, None, :])])
        hidden = self.model.forward(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
        return self.model.compute_logits(hidden)

    def _replays_eager_step(self) -> bool:
        size, width = self.sizes[-1], self.widths[-1]
        self.fill(size, DecodeInputs.empty())
        replay, logits = self.graphs[(size, width)]
        replay()
        eager = self.step(size, width)
        return bool(torch.allclose(logits, eager, rtol=1e-3, atol=1e-3))

    def key_for(self, num_decodes: int, max_blocks: int) -> tuple[int, int] | None:
        """The smallest captured graph for this many decodes and this longest context, if any."""
        if not self.graphs:
            return None
        size, width = smallest_at_least(self.sizes, num_decodes), smallest_at_least(self.widths, max_blocks)
        return None if size is None or width is None else (size, width)

    def run(self, key: tuple[int, int], inputs: DecodeInputs) -> torch.Tensor:
        """Logits [decodes, vocab] of one decode step: a view of the graph's output, valid until
        the next replay."""
        self.fill(key[0], inputs)
        replay, logits = self.graphs[key]
        replay()
        return logits[: len(inputs.token_ids)]

    def fill(self, size: int, inputs: DecodeInputs) -> None:
        """Copy one step's inputs into the first `size` rows, padding the rest (see the module)."""
        rows = len(inputs.token_ids)
        pad = size - rows

        def padded(values: np.ndarray, fill: int) -> torch.Tensor:
            return torch.from_numpy(np.concatenate([values, np.full(pad, fill, np.int64)]))

        self.input_ids[:size].copy_(padded(inputs.token_ids, 0), non_blocking=True)
        self.positions[:size].copy_(padded(inputs.positions, 0), non_blocking=True)
        self.slots[:size].copy_(padded(inputs.slots, self.spare_slot), non_blocking=True)
        self.context_lens[:size].copy_(padded(inputs.context_lens, 1), non_blocking=True)
        tables = np.zeros((size, self.block_tables.shape[1]), np.int64)
        tables[:rows, : inputs.block_tables.shape[1]] = inputs.block_tables
        self.block_tables[:size].copy_(torch.from_numpy(tables), non_blocking=True)
