"""The engine loop: add_request -> step (schedule, forward, sample, detokenize) -> outputs.

Synchronous by design: one thread calls add_request / abort_request / step (the replica
server's async wrapper owns that thread); stats() may be read from another thread.

Semantics worth knowing:

- A request with `n > 1` becomes n sequences. The first computes the prompt; the others start
  once it has (so with prefix caching they take its full blocks and recompute at most the last
  partial block). `seed + index` seeds sequence `index` when the request has a seed; without
  one, the engine's `EngineConfig.seed` stream seeds it, so a whole run is reproducible.
- `abort_request` frees the request's blocks at once; the next `step()` returns one
  `finish_reason="abort"` output for each of its sequences that had not finished.
- Finish order of checks per new token: stop_token_ids / EOS ("stop", the token is kept in
  `new_token_ids`, special tokens are not in the text), stop strings ("stop", text cut before
  the stop string), then max_tokens ("length").
- logit_bias, min_tokens (EOS and stop_token_ids banned until then) and the penalties
  (repetition, frequency, presence) change a row's logits in that order before it is sampled,
  greedy rows included; logprobs are read before all of them, from the model's own
  distribution. Stop strings count from min_tokens on.
- Preempted sequences keep their output and are recomputed (prompt + output) when readmitted.
- A sequence whose logits are NaN or infinite ends its whole request at once, with one
  `finish_reason="error"` output per unfinished sequence; the rest of the batch goes on.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from itertools import count

import torch

from runtime.engine.block_manager import BlockManager
from runtime.engine.config import EngineConfig, ModelConfig
from runtime.engine.model_runner import ModelRunner, kv_bytes_per_block, num_kv_blocks_for
from runtime.engine.plan import resolve_plan
from runtime.engine.sampling import (
    INVALID_TOKEN,
    Sampler,
    SamplingParams,
    TokenLogprob,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    ban_tokens,
    token_logprobs,
)
from runtime.engine.scheduler import ScheduledChunk, Scheduler
from runtime.engine.sequence import Sequence
from runtime.engine.slo_scheduling import SlackHistogram, SloTargets
from runtime.engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


# Prompt positions whose logits are made at once for prompt logprobs: 256 rows of a 152k
# vocabulary are 156 MB of float32 (twice that with their log-softmax).
PROMPT_LOGITS_ROWS = 256


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class CompletionOutput:
    """One step's news for one of the n sequences of a request."""

    request_id: str
    index: int  # 0..n-1
    new_token_ids: list[int]
    new_text: str  # text delta (stop strings already cut)
    finished: bool
    # "stop" | "length" | "abort" | "error" (the model's logits were NaN or infinite) | "late"
    # (refused: it could no longer meet its TTFT target, slo policy with reject_late) | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # What ended a "stop": the stop string or stop token id, None for EOS (as vLLM says it).
    stop_reason: str | int | None = None
    # One per new token when the request asked for logprobs; None otherwise.
    logprobs: list[TokenLogprob] | None = None
    # One per prompt token, on the first output of sequence 0 of a request that asked for
    # prompt logprobs.
    prompt_logprobs: list[TokenLogprob] | None = None
    # With finish_reason "late": seconds after which the engine expects to have room again.
    retry_after_s: int | None = None


@dataclass
class EngineStats:
    num_running: int  # sequences (a request with n=4 counts 4)
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
    prompt_tokens_total: int
    generation_tokens_total: int
    num_kv_blocks: int = 0
    block_size: int = 0
    scheduling_policy: str = "priority"
    slo_rejected_late_total: int = 0
    slo_demoted_late_total: int = 0
    slo_admission_slack: SlackHistogram | None = None  # slo policy only


@dataclass
class _SequenceState:
    """What the engine keeps beside the scheduler's Sequence: sampling and text state."""

    seq: Sequence
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    _distinct_prompt_ids: torch.Tensor | None = None

    def distinct_prompt_ids(self) -> torch.Tensor:
        """What the repetition penalty looks up in the prompt, made once a sequence."""
        if self._distinct_prompt_ids is None:
            self._distinct_prompt_ids = torch.tensor(self.seq.prompt_token_ids).unique()
        return self._distinct_prompt_ids


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    states: list[_SequenceState]
    pending_siblings: list[Sequence] = field(default_factory=list)
    num_unfinished: int = 0
    # By position, filled in as the prompt's chunks are computed (prompt_logprobs only).
    prompt_logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.served_model_name = config.served_model_name or config.model
        self.plan = resolve_plan(config, self.model_config.checkpoint_dtype)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.runner = ModelRunner(
            config, self.model_config, self.plan, self.max_model_len,
            num_kv_blocks_for(config, self.model_config, self.max_model_len, self.plan.kv_cache_dtype),
        )
        self.num_kv_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(
            self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_prefill_tokens_with_decodes, config.background_priority,
            config.background_tokens_per_step, config.scheduling_policy, config.slo_reject_late,
        )
        self.default_targets = SloTargets.from_ms(config.slo_ttft_ms, config.slo_tpot_ms)
        self.sampler = Sampler()
        kv_bytes = self.num_kv_blocks * kv_bytes_per_block(
            self.model_config, config.block_size, self.plan.kv_cache_dtype)
        logger.info("%s; %d KV blocks of %d tokens (%.0f MiB)", self.plan.describe(),
                    self.num_kv_blocks, config.block_size, kv_bytes / 2**20)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(
            self.model_config.eos_token_ids
        )
        self._seed_source = random.Random(config.seed)
        self._arrivals = count()
        self._requests: dict[str, _Request] = {}
        self._states: dict[int, _SequenceState] = {}  # by seq_id
        self._aborted_outputs: list[CompletionOutput] = []
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        # A plain counter so stats() never iterates what the stepping thread mutates.
        self._num_pending_siblings = 0

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        targets: SloTargets | None = None,
    ) -> None:
        """`arrival_time` (time.monotonic seconds, default now) starts the TTFT clock; `targets`
        missing a phase take the engine's `default_targets` for it."""
        self._validate(request_id, prompt_token_ids, params)
        arrival = next(self._arrivals)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        targets = (targets or SloTargets()).or_else(self.default_targets)
        request = _Request(request_id, params, states=[], num_unfinished=params.n)
        for index in range(params.n):
            seq = Sequence(
                request_id,
                prompt_token_ids,
                index=index,
                priority=priority,
                arrival=arrival,
                max_tokens=params.max_tokens,
                arrival_time=arrival_time,
                ttft_deadline=None if targets.ttft_s is None else arrival_time + targets.ttft_s,
                tpot_target=targets.tpot_s,
            )
            state = _SequenceState(
                seq,
                self._generator(params, index),
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop),
            )
            request.states.append(state)
            self._states[seq.seq_id] = state
        # Siblings wait until the first sequence has computed the prompt: they then take its
        # blocks from the prefix cache instead of computing the same prompt n times, and the
        # prompt's logprobs (which only the first computes) are out before any of them reports.
        first, *siblings = [s.seq for s in request.states]
        if params.prompt_logprobs is not None:
            first.needs_prompt_logits = True
            request.prompt_logprobs = [TokenLogprob(prompt_token_ids[0], None, ())] * len(
                prompt_token_ids)
        siblings_wait = self.config.enable_prefix_caching or params.prompt_logprobs is not None
        request.pending_siblings = siblings if siblings_wait else []
        self._num_pending_siblings += len(request.pending_siblings)
        self._requests[request_id] = request
        self.scheduler.add(first)
        if not siblings_wait:
            for seq in siblings:
                self.scheduler.add(seq)
        self._prompt_tokens_total += len(prompt_token_ids)

    def _validate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequest("prompt must contain at least one token", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                                 "prompt")
        bad = [t for t in params.logit_bias or {} if t >= vocab]
        if bad:
            raise InvalidRequest(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}",
                                 "logit_bias")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds the model's maximum context length ({self.max_model_len})",
                "max_tokens")
        blocks = self.block_manager.blocks_for_tokens(total)
        if blocks > self.num_kv_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks but the cache "
                f"only has {self.num_kv_blocks} blocks of {self.config.block_size} tokens",
                "max_tokens")

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        # A request seed makes each of its n sequences reproducible (seed + index); without
        # one the engine's own seeded stream picks, so a whole run is reproducible too.
        seed = params.seed + index if params.seed is not None else self._seed_source.getrandbits(63)
        return torch.Generator().manual_seed(seed)

    def abort_request(self, request_id: str) -> None:
        """Drop a request now and free its blocks; the next step() reports it as aborted."""
        self._aborted_outputs += self._drop(request_id, "abort")

    def _drop(self, request_id: str, reason: str) -> list[CompletionOutput]:
        """End every unfinished sequence of a request with `reason`, freeing its blocks."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return []
        self.scheduler.abort(request_id)
        self._num_pending_siblings -= len(request.pending_siblings)
        outputs = []
        for state in request.states:
            seq = state.seq
            if seq.finish_reason in (None, "abort", reason):
                outputs.append(self._output(state, [], "", reason))
            self._states.pop(seq.seq_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted_outputs)

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[CompletionOutput]:
        outputs, self._aborted_outputs = self._aborted_outputs, []
        scheduled = self.scheduler.schedule()
        for seq in scheduled.rejected:
            for output in self._drop(seq.request_id, "late"):
                output.retry_after_s = scheduled.retry_after_s
                outputs.append(output)
        if scheduled.is_empty:
            return outputs
        started = time.monotonic()
        logits, prompt_hidden = self.runner.execute(scheduled)
        self.scheduler.on_chunks_computed(scheduled, time.monotonic() - started)
        sampled = [c.seq for c in scheduled.chunks if c.completes_sequence]
        if len(prompt_hidden):
            with self.runner.sampling_device():
                self._record_prompt_logprobs(scheduled.prefills, prompt_hidden)
        states = [self._states[seq.seq_id] for seq in sampled]
        params = [self._requests[seq.request_id].params for seq in sampled]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Taken before the logits change below: logprobs report the model's own
        # distribution, as vLLM's do by default.
        logprobs: dict[int, TokenLogprob] = {}
        with self.runner.sampling_device():
            raw_logprobs = logits[logprob_rows].log_softmax(dim=-1) if logprob_rows else None
            self._process_logits(logits, states, params)
            token_ids = self.sampler(logits, params, [s.generator for s in states])
            if raw_logprobs is not None:
                usable = [j for j, i in enumerate(logprob_rows) if token_ids[i] != INVALID_TOKEN]
                if usable:
                    rows = [logprob_rows[j] for j in usable]
                    logprobs = dict(zip(rows, token_logprobs(
                        raw_logprobs[usable], [token_ids[i] for i in rows],
                        [params[i].logprobs for i in rows]), strict=True))
        for row, (state, token_id) in enumerate(zip(states, token_ids, strict=True)):
            request_id = state.seq.request_id
            if request_id not in self._requests:  # a sibling failed earlier in this loop
                continue
            if token_id == INVALID_TOKEN:
                # Only this request fails: its logits were NaN or infinite, which says its
                # numbers overflowed or the weights are broken, not that the engine is.
                logger.error("request %s failed: the model's logits for it are NaN or "
                             "infinite", request_id)
                outputs += self._drop(request_id, "error")
            else:
                outputs.append(self._append_token(state, token_id, logprobs.get(row)))
        return outputs

    def _process_logits(self, logits: torch.Tensor, states: list[_SequenceState],
                        params: list[SamplingParams]) -> None:
        """In vLLM's order, in place, only on the rows that ask for it: logit bias, the
        stop tokens banned before min_tokens, the penalties, then min_p (the sampler applies
        temperature, top-k and top-p after it)."""
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            apply_logit_bias(logits, biased, [params[i].logit_bias for i in biased])
        too_short = [i for i, (state, p) in enumerate(zip(states, params, strict=True))
                     if state.seq.num_output_tokens < p.min_tokens]
        if too_short:
            ban_tokens(logits, too_short, [[*params[i].stop_token_ids,
                                            *([] if params[i].ignore_eos else self.eos_token_ids)]
                                           for i in too_short])
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            apply_penalties(logits, penalized, [params[i] for i in penalized],
                            [states[i].distinct_prompt_ids() for i in penalized],
                            [states[i].seq.output_token_ids for i in penalized])
        filtered = [i for i, p in enumerate(params) if p.min_p > 0 and not p.is_greedy]
        if filtered:
            apply_min_p(logits, filtered, [params[i] for i in filtered])

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk],
                                hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens after each chunk's positions: position p's logits
        predict token p + 1. `hidden` has a row for every token of the chunks whose sequence
        needs prompt logits, in order; their logits are made PROMPT_LOGITS_ROWS at a time."""
        offset = 0
        for chunk in chunks:
            seq = chunk.seq
            if not seq.needs_prompt_logits:
                continue
            start, offset = offset, offset + chunk.num_tokens
            request = self._requests.get(seq.request_id)
            last = min(chunk.end, seq.num_prompt_tokens - 1)  # the last position predicted
            if last <= chunk.start or request is None or request.prompt_logprobs is None:
                continue
            for first in range(chunk.start, last, PROMPT_LOGITS_ROWS):
                end = min(first + PROMPT_LOGITS_ROWS, last)
                rows = hidden[start + first - chunk.start:start + end - chunk.start]
                request.prompt_logprobs[first + 1:end + 1] = token_logprobs(
                    self.runner.prompt_logits(rows).log_softmax(dim=-1),
                    seq.token_ids[first + 1:end + 1],
                    [request.params.prompt_logprobs] * (end - first))

    def _append_token(self, state: _SequenceState, token_id: int,
                      logprob: TokenLogprob | None) -> CompletionOutput:
        seq = state.seq
        request = self._requests[seq.request_id]
        params = request.params
        seq.append_token(token_id, time.monotonic())
        self._generation_tokens_total += 1
        if seq.index == 0 and request.pending_siblings:
            for sibling in request.pending_siblings:
                sibling.ttft_deadline = None  # the request has its first token
                self.scheduler.add(sibling)
            self._num_pending_siblings -= len(request.pending_siblings)
            request.pending_siblings = []
        reason = stop_reason = None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            reason = "stop"
        elif token_id in params.stop_token_ids:
            reason, stop_reason = "stop", token_id
        elif seq.num_output_tokens >= params.max_tokens:
            reason = "length"
        text, stop_string = state.detokenizer.update(
            seq.output_token_ids, reason is not None,
            check_stop=seq.num_output_tokens >= params.min_tokens)
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
        if reason is not None:
            self._finish(request, state, reason)
        output = self._output(state, [token_id], text, reason)
        output.stop_reason = stop_reason
        output.logprobs = [logprob] if logprob is not None else None
        if seq.needs_prompt_logits:  # its prompt is done: hand its logprobs over, once
            seq.needs_prompt_logits = False
            output.prompt_logprobs = request.prompt_logprobs
        return output

    def _finish(self, request: _Request, state: _SequenceState, reason: str) -> None:
        self.scheduler.finish(state.seq, reason)
        self._states.pop(state.seq.seq_id, None)
        request.num_unfinished -= 1
        if request.num_unfinished == 0:
            del self._requests[request.request_id]

    def _output(
        self, state: _SequenceState, new_token_ids: list[int], text: str, reason: str | None
    ) -> CompletionOutput:
        seq = state.seq
        return CompletionOutput(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- reporting and offline use --------------------------------------------------------------

    def stats(self) -> EngineStats:
        counters = self.scheduler.counters
        slo = self.scheduler.slo
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + self._num_pending_siblings,
            kv_cache_usage=self.block_manager.usage,
            num_preemptions_total=counters.num_preemptions,
            prefix_cache_queries_total=counters.prefix_cache_queries,
            prefix_cache_hits_total=counters.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            scheduling_policy=self.config.scheduling_policy,
            slo_rejected_late_total=slo.rejected_late if slo else 0,
            slo_demoted_late_total=slo.demoted_late if slo else 0,
            slo_admission_slack=slo.slack if slo else None,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; output token ids per prompt, in prompt order.

        With n > 1 a prompt contributes its n sequences one after another.
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"generate-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        results: dict[tuple[str, int], list[int]] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                results.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        return [
            results.get((rid, i), [])
            for rid, p in zip(ids, params_list, strict=True)
            for i in range(p.n)
        ]
