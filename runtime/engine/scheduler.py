"""What runs next: continuous batching with chunked prefill, priorities and preemption.

Pure Python, no torch. Each step spends a token budget (`max_num_batched_tokens`):

1. running sequences with one token to compute (decodes) go first, one token each;
   when there are any, prefill chunks get at most `max_prefill_tokens_with_decodes` of what
   is left (if set), so a long prompt does not stretch every stream's time per token;
2. running sequences still in their prompt get the next chunk of it;
3. waiting sequences are admitted (higher priority first, first come first served within a
   priority), using the prefix cache, with a first chunk that fits what is left.

Background work (priority at or below `background_priority`, the lowest by default: eval runs and
other offline scoring) runs in the capacity foreground requests leave: while any foreground
sequence runs or waits, background sequences get at most `background_tokens_per_step` tokens of
a step between them, so they add a little to each step instead of a whole prefill chunk. A
foreground request that finds every slot (`max_num_seqs`) or every free block taken preempts
background sequences to get in: offline batches never hold an interactive request back.

When a running sequence needs a block and none is free, the lowest-priority, newest running
sequence not yet scheduled this step is preempted (blocks freed, sent back to waiting to be
recomputed later); if that is the sequence itself, it waits.

The policy (`--scheduling-policy`) orders the queues: `priority` (the default) as above; `fcfs`
by arrival alone, priorities ignored (vLLM's default, for comparison); `slo` plans each step for
the requests' TTFT and TPOT targets (runtime/engine/slo_scheduling.py): the step's budget, the
waiting order, how many may run, and which requests are late. Late requests come last among
running ones too, so they are the first preempted.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.engine.block_manager import BlockManager
from runtime.engine.sequence import Sequence, SequenceStatus
from runtime.engine.slo_scheduling import POLICIES, SloPlanner


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens at scheduling)
    num_tokens: int
    # After this chunk every token has KV, so the model's last output row here is sampled.
    completes_sequence: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Refused as late (slo policy with reject_late): finished by the scheduler, to be reported.
    rejected: list[Sequence] = field(default_factory=list)
    retry_after_s: int = 1

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found


@dataclass
class _StepState:
    """What is left of one step as the scheduler fills it."""

    budget: int  # tokens
    background_left: int | None  # tokens background sequences may still take (None: no cap)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_tokens_with_decodes: int | None = None, background_priority: int | None = None,
                 background_tokens_per_step: int = 16, policy: str = "priority",
                 reject_late: bool = False, clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self.clock = clock
        self.slo = SloPlanner(reject_late) if policy == "slo" else None
        self._plan = None
        self.block_manager = block_manager
        self.background_priority = background_priority
        self.background_tokens_per_step = background_tokens_per_step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        # Both kept sorted by _key: front = first served (highest priority, oldest, by default).
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()

    def _key(self, seq: Sequence) -> tuple:
        if self.policy == "fcfs":
            return (seq.arrival, seq.seq_id)
        if self.policy == "slo":
            return (-seq.priority, seq.late, seq.arrival, seq.seq_id)
        return seq.schedule_key

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the batch for good and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = [s for s in self.running + self.waiting if s.request_id == request_id]
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted

    # -- one step ---------------------------------------------------------------------------

    def is_background(self, seq: Sequence) -> bool:
        return self.background_priority is not None and seq.priority <= self.background_priority

    def _background_allowance(self) -> int | None:
        """Tokens background sequences may take this step: capped while foreground work runs or
        waits (both lists are sorted highest priority first), else no cap (None)."""
        if self.background_priority is None:
            return None
        if self.policy == "fcfs":  # queues are in arrival order: look at every sequence
            foreground = any(not self.is_background(s) for s in self.running + self.waiting)
        else:  # highest priority first
            foreground = any(not self.is_background(q[0]) for q in (self.running, self.waiting) if q)
        return self.background_tokens_per_step if foreground else None

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        max_running = self.max_num_seqs
        if self.slo is not None:
            now = self.clock()
            plan = self.slo.plan(self, now)
            budget, max_running = plan.budget, plan.max_running
            self.waiting = self.slo.order_waiting(self, plan, now, self._prefill_need)
            for seq in self.slo.rejected:
                self.finish(seq, "late")
            out.rejected = self.slo.rejected
            if out.rejected:
                out.retry_after_s = self.slo.retry_after_s(self, plan.prefill_rate)
            self._plan = plan
        self._make_way_for_foreground(out, max_running, budget)
        scheduled: set[int] = set()
        background_left = self._background_allowance()
        cap = self.max_prefill_tokens_with_decodes
        state = _StepState(budget, background_left)
        self._run_running(out, state, scheduled, decodes=True)
        if out.decodes and cap is not None:
            state.budget = min(state.budget, cap)
        if self.slo is None:
            self._run_running(out, state, scheduled, decodes=False)
            self._admit_waiting(state, out, max_running)
            return out
        # Late requests' prefill yields to every request that can still make its deadline.
        self._run_running(out, state, scheduled, decodes=False, late=False)
        self._admit_waiting(state, out, max_running, late=False)
        self._run_running(out, state, scheduled, decodes=False, late=True)
        self._admit_waiting(state, out, max_running)
        return out

    def _run_running(self, out: SchedulerOutput, state: _StepState, scheduled: set[int], decodes: bool,
                     late: bool | None = None) -> None:
        """Schedule running sequences' decodes (or prefill chunks; only late or only on-time ones
        when `late` says so) within the step's budget."""
        for seq in list(self.running):
            if state.budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.seq_id in scheduled:
                continue
            if (seq.num_uncomputed_tokens == 1) != decodes or (late is not None and seq.late != late):
                continue
            wanted = min(seq.num_uncomputed_tokens, state.budget)
            capped = state.background_left is not None and self.is_background(seq)
            if capped:
                wanted = min(wanted, state.background_left)
                if wanted == 0:
                    continue
            num_tokens = self._make_room(seq, wanted, scheduled, out)
            if num_tokens == 0:
                continue
            chunk = self._allocate(seq, num_tokens)
            (out.decodes if decodes else out.prefills).append(chunk)
            scheduled.add(seq.seq_id)
            state.budget -= num_tokens
            if capped:
                state.background_left -= num_tokens

    def _prefill_need(self, seq: Sequence) -> int:
        """Tokens a waiting sequence must compute before its first token (less its cached prefix)."""
        bm = self.block_manager
        if bm.enable_prefix_caching and not seq.needs_prompt_logits and not seq.was_admitted:
            return max(len(seq) - len(bm.find_cached_prefix(seq)) * bm.block_size, 1)
        return len(seq) - seq.num_computed_tokens

    def on_chunks_computed(self, out: SchedulerOutput, seconds: float | None = None) -> None:
        """The model wrote KV for every scheduled chunk (in `seconds`, when measured): advance
        and publish full blocks."""
        if self.slo is not None and seconds is not None:
            self.slo.cost.observe(out.num_batched_tokens, seconds)
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens = chunk.end
            self.block_manager.register_computed_blocks(chunk.seq)

    def _allocate(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        self.block_manager.allocate_slots(seq, num_tokens)
        start = seq.num_computed_tokens
        return ScheduledChunk(seq, start, num_tokens, start + num_tokens == len(seq))

    def _make_room(
        self, seq: Sequence, wanted: int, scheduled: set[int], out: SchedulerOutput
    ) -> int:
        """Tokens of `seq` that can run now (up to `wanted`), preempting others if needed.

        Returns 0 when `seq` itself had to be preempted.
        """
        while True:
            fits = min(wanted, self.block_manager.max_tokens_allocatable(seq))
            if fits >= 1:
                return fits
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        self.add(seq)
        self.counters.num_preemptions += 1
        out.preempted.append(seq)

    def _make_way_for_foreground(self, out: SchedulerOutput, max_running: int, budget: int) -> None:
        """Before the step: preempt background sequences (newest first) until the foreground requests
        waiting have the slots and the blocks for their first chunks this step."""
        foreground = [seq for seq in self.waiting if not self.is_background(seq)]
        if not foreground or self.background_priority is None:
            return
        running_foreground = sum(1 for seq in self.running if not self.is_background(seq))
        wanted = foreground[:max(0, max_running - running_foreground)]
        tokens = 0
        for seq in wanted:
            tokens += max(0, min(len(seq) - seq.num_computed_tokens, budget - tokens))
        bm = self.block_manager
        blocks = -(-tokens // bm.block_size) + len(wanted)  # + a partly filled block each
        while wanted and (len(self.running) + len(wanted) > max_running or bm.num_free_blocks < blocks):
            victim = next((seq for seq in reversed(self.running) if self.is_background(seq)), None)
            if victim is None:
                return
            self._preempt(victim, out)

    def _admit_waiting(self, state: _StepState, out: SchedulerOutput, max_running: int,
                       late: bool | None = None) -> None:
        """Admit waiting sequences in queue order (stopping at the first late one when `late` is
        False) with a first chunk each, within the step's budget."""
        bm = self.block_manager
        while self.waiting and state.budget > 0:
            seq = self.waiting[0]
            if late is False and seq.late:
                break
            if len(self.running) >= max_running:
                break
            uses_cache = bm.enable_prefix_caching and not seq.needs_prompt_logits
            cached = bm.find_cached_prefix(seq) if uses_cache else []
            num_cached_tokens = len(cached) * bm.block_size
            free_after_prefix = bm.num_free_blocks - bm.num_free_needed_for_prefix(cached)
            room = (len(cached) + free_after_prefix) * bm.block_size - num_cached_tokens
            num_tokens = min(len(seq) - num_cached_tokens, state.budget, room)
            capped = state.background_left is not None and self.is_background(seq)
            if capped:
                num_tokens = min(num_tokens, state.background_left)
            if num_tokens < 1:
                break  # strict order: nobody overtakes the head of the queue
            self.waiting.pop(0)
            if uses_cache:
                self.counters.prefix_cache_queries += len(seq)
                self.counters.prefix_cache_hits += num_cached_tokens
            bm.allocate_prefix(seq, cached)
            if not seq.was_admitted:
                seq.num_cached_tokens = min(num_cached_tokens, seq.num_prompt_tokens)
                seq.was_admitted = True
                if self.slo is not None:
                    self.slo.on_admitted(seq, self.clock(), len(seq) - num_cached_tokens,
                                         self._plan.prefill_rate)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            out.prefills.append(self._allocate(seq, num_tokens))
            state.budget -= num_tokens
            if capped:
                state.background_left -= num_tokens
