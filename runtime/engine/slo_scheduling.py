"""Scheduling for SLOs (`--scheduling-policy slo`): serve as many requests as possible within
their TTFT and TPOT targets (goodput), not just as many tokens.

Each request carries a TTFT deadline (arrival + its TTFT target) and a TPOT target. Before every
step the planner here decides, from a step-time model fitted on the engine's own recent steps:

- **How big the step may be** (the TPOT guard). Every running stream that has its first token has
  a credit: the time its mean TPOT still allows before this step ends. The step's token budget is
  what the model says fits in the smallest credit (clamped to a fraction and a multiple of the
  target), so prefill chunks never stretch a stream past its TPOT; with no stream decoding the
  whole budget goes to prefill. This is Sarathi-Serve's stall-free chunked prefill with the chunk
  sized per step from the streams' targets, as SLOs-Serve allocates tokens per SLO, rather than
  from a fixed `max_num_batched_tokens`.
- **Who is admitted, in what order** (the TTFT guard). Waiting requests are ordered by slack:
  time left to their TTFT deadline less the prefill they need at the measured prefill speed
  (least slack first: SCORPIO's least-deadline-first with the prefill accounted for). Walking that
  order, each request's first token is predicted after the prefill work queued ahead of it; one
  that can no longer make its deadline is *late*: served after every request that still can
  (default), or refused at once with a 503 and Retry-After (`--slo-reject-late`, SCORPIO's early
  rejection), so its work does not make the requests behind it late too. A short request moves
  ahead only where the requests it overtakes keep their deadlines. A request with nothing ahead of
  it is served unless its deadline has passed, whatever the estimate says, and while requests wait
  for a first token a step takes at most a quarter of their tightest TTFT target (a step cannot be
  interrupted for a request that arrives during it).
- **How many may run** (SCORPIO's virtual batch size): a request is admitted only while the
  running streams plus a minimum prefill share fit in the step the TPOT guard allows, so admitting
  one more never makes every stream's TPOT miss.

Priorities from API keys still order the classes: a higher class is always planned first.
Goodput (requests meeting both targets per second) is the objective, as in DistServe; JITServe's
"just enough" per-request bandwidth is what the credit gives a stream that is ahead of its target.

References: DistServe (Zhong et al., OSDI 2024), Sarathi-Serve (Agrawal et al., OSDI 2024), SCORPIO
(2025, "Serving the Right Requests at the Right Time"), SLOs-Serve (2025), JITServe (2025). Their
figures are GPU results on their workloads; this engine's are measured in bench/engine/slo_bench.py.

Pure Python, no torch; time comes from an injectable clock so tests run in simulated time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.engine.scheduler import Scheduler
    from runtime.engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "slo")
# Slack at admission (seconds), as a histogram: negative is already late.
SLACK_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
# A step may use at most this share of the tightest stream's TPOT target when no stream has
# credit to spare: the model's estimate is not exact and a miss costs a whole request.
TPOT_MARGIN = 0.9
# How far a stream's earned credit may stretch one step, as a multiple of its target: a credit
# spent in one long step shows as one long inter-token gap.
MAX_CREDIT_STEP = 2.5
# While requests wait for their first token, a step takes at most this share of their tightest TTFT
# target, so one arriving during a step still has most of its target left.
RESPONSIVE_STEP_SHARE = 0.25
# While requests wait for their prefill, at least this share of a step's budget is theirs.
MIN_PREFILL_SHARE = 0.25
MIN_PREFILL_TOKENS = 16
# Short-job reordering looks this far into the queue, to keep planning cheap.
REORDER_WINDOW = 32


@dataclass(frozen=True)
class SloTargets:
    """A request's targets in seconds; None: no target in that phase."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> SloTargets:
        return cls(None if ttft_ms is None else ttft_ms / 1000,
                   None if tpot_ms is None else tpot_ms / 1000)

    def or_else(self, fallback: SloTargets) -> SloTargets:
        """These targets, each missing one taken from `fallback`."""
        return SloTargets(self.ttft_s if self.ttft_s is not None else fallback.ttft_s,
                          self.tpot_s if self.tpot_s is not None else fallback.tpot_s)


class StepCostModel:
    """Seconds of one engine step ~ fixed + per_token x tokens, fitted by exponentially weighted
    least squares on the engine's recent steps. While the steps seen are all of about one size the
    line is unknown: the fixed part is taken as the constructor's guess (at most half the mean
    step) and the rest as per-token time; before any step the guess is all there is."""

    def __init__(self, fixed_s: float = 0.02, per_token_s: float = 0.002, decay: float = 0.97) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weight, x, y, xx, xy of the observed steps (decayed)
        self.fixed_s, self.per_token_s = fixed_s, per_token_s
        self.default_fixed_s = fixed_s

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        w, x, y, xx, xy = (s * self.decay for s in self._sums)
        self._sums = [w + 1, x + tokens, y + seconds, xx + tokens * tokens, xy + tokens * seconds]
        w, x, y, xx, xy = self._sums
        mean_x, mean_y = x / w, y / w
        var = xx / w - mean_x * mean_x
        if w >= 3 and var > (0.2 * mean_x) ** 2:
            self.per_token_s = max((xy / w - mean_x * mean_y) / var, 1e-7)
            self.fixed_s = max(mean_y - self.per_token_s * mean_x, 0.0)
        else:  # steps of one size: the fixed part guessed (at most half a step), the rest per token
            self.fixed_s = min(self.default_fixed_s, 0.5 * mean_y)
            self.per_token_s = (mean_y - self.fixed_s) / mean_x

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * max(tokens, 0)

    def tokens_within(self, seconds: float) -> int:
        return max(int((seconds - self.fixed_s) / self.per_token_s), 0)


class SlackHistogram:
    """Cumulative bucket counts, read by the replica's /metrics collector."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(SLACK_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = next((i for i, edge in enumerate(SLACK_BUCKETS) if value <= edge), len(SLACK_BUCKETS))
        self.buckets[index] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        total, rows = 0, []
        for edge, n in zip((*(f"{e:g}" for e in SLACK_BUCKETS), "+Inf"), self.buckets, strict=True):
            total += n
            rows.append((edge, total))
        return rows


@dataclass
class SloPlan:
    """What the planner decided for one step."""

    budget: int  # tokens this step may carry
    max_running: int  # sequences that may run after admission (the virtual batch size)
    prefill_rate: float  # prefill tokens a second at this step's size (estimate)


class SloPlanner:
    def __init__(self, reject_late: bool, cost: StepCostModel | None = None) -> None:
        self.reject_late = reject_late
        self.cost = cost or StepCostModel()
        self.slack = SlackHistogram()
        self.rejected: list[Sequence] = []  # refused by the last order_waiting (reject_late)
        self.rejected_late = 0
        self.demoted_late = 0

    # -- the step's size ------------------------------------------------------------------

    def step_allowance(self, running: Iterable[Sequence], now: float) -> float:
        """Seconds this step may take so that no on-time decoding stream's mean TPOT misses."""
        allowed = math.inf
        for seq in running:
            target = seq.tpot_target
            if target is None or seq.late or seq.first_token_time is None:
                continue
            # After this step the stream has produced num_output_tokens + 1 tokens; its mean
            # gap over them may be at most the target.
            # A tenth of a target stays in reserve, for the model's error.
            credit = target * seq.num_output_tokens - (now - seq.first_token_time) - (1 - TPOT_MARGIN) * target
            allowed = min(allowed, min(max(credit, TPOT_MARGIN * target), MAX_CREDIT_STEP * target))
        return allowed

    @staticmethod
    def _responsive_step(scheduler: Scheduler) -> float:
        """A step cannot be interrupted: requests that arrive during it lose its whole length. While
        requests with a TTFT target wait, a step takes at most a share of the tightest such target."""
        targets = [seq.ttft_deadline - seq.arrival_time for seq in scheduler.waiting
                   if seq.ttft_deadline is not None and not seq.late and seq.first_token_time is None]
        return RESPONSIVE_STEP_SHARE * min(targets) if targets else math.inf

    def plan(self, scheduler: Scheduler, now: float) -> SloPlan:
        max_budget = scheduler.max_num_batched_tokens
        running = scheduler.running
        num_decodes = sum(1 for s in running if s.num_uncomputed_tokens == 1)
        allowed = min(self.step_allowance(running, now), self._responsive_step(scheduler))
        budget = max_budget if allowed == math.inf else self.cost.tokens_within(allowed)
        prefill_floor = max(MIN_PREFILL_TOKENS, int(MIN_PREFILL_SHARE * budget))
        if scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in running):
            budget = max(budget, num_decodes + prefill_floor)
        budget = min(max(budget, num_decodes, 1), max_budget)
        prefill_tokens = max(budget - num_decodes, min(MIN_PREFILL_TOKENS, budget))
        rate = prefill_tokens / self.cost.seconds(budget)
        # Streams that fit beside a minimum prefill share in the step the tightest target allows.
        tightest = min((s.tpot_target for s in running if s.tpot_target is not None and not s.late),
                       default=None)
        max_running = scheduler.max_num_seqs
        if tightest is not None:
            room = self.cost.tokens_within(TPOT_MARGIN * tightest)
            max_running = min(max_running, max(room - max(MIN_PREFILL_TOKENS, int(MIN_PREFILL_SHARE * room)), 1))
        return SloPlan(budget, max_running, rate)

    # -- who goes first -------------------------------------------------------------------

    def order_waiting(self, scheduler: Scheduler, plan: SloPlan, now: float,
                      need: Callable[[Sequence], int]) -> list[Sequence]:
        """The waiting queue in the order to admit: by priority class, then streams resuming (after
        a preemption, or siblings of a request already answering), then requests that can still
        make their TTFT (least slack first), then late ones (first come first served). Requests
        found late are marked (for good) and, with reject_late, returned in `self.rejected`
        instead."""
        self.rejected = []
        rate = plan.prefill_rate
        needs: dict[int, int] = {}

        def need_of(seq: Sequence) -> int:  # a prefix cache lookup each: once per plan
            if seq.seq_id not in needs:
                needs[seq.seq_id] = need(seq)
            return needs[seq.seq_id]

        classes: dict[int, list[Sequence]] = {}
        for seq in scheduler.waiting:
            classes.setdefault(seq.priority, []).append(seq)
        # Prefill already under way is ahead of every waiting request of its class or lower.
        queued = 0.0
        ordered: list[Sequence] = []
        for priority in sorted(classes, reverse=True):
            queued += sum(s.num_uncomputed_tokens for s in scheduler.running
                          if s.priority == priority and s.first_token_time is None)
            resuming, hopeful, late = [], [], []
            for seq in classes[priority]:
                # Streams already under way (preempted, or a sibling of an answered request) have
                # no TTFT left to meet: they resume first.
                if seq.first_token_time is not None or seq.ttft_deadline is None:
                    resuming.append(seq)
                elif seq.late:
                    late.append(seq)
                else:
                    seq.slack = seq.ttft_deadline - now - need_of(seq) / rate
                    hopeful.append(seq)
            hopeful.sort(key=lambda s: (s.slack, s.arrival, s.seq_id))
            on_time: list[Sequence] = []
            for seq in hopeful:
                # With nothing ahead of it, now is its best chance: unless its deadline has passed it is
                # served whatever the estimate says (which also keeps the step-time model learning when
                # it misjudges the machine, instead of refusing everything from then on).
                alone = queued == 0 and not scheduler.running
                predicted = now if alone else now + (queued + need_of(seq)) / rate
                if predicted > seq.ttft_deadline:
                    self._mark_late(seq, late)
                else:
                    queued += need_of(seq)
                    on_time.append(seq)
            late.sort(key=lambda s: (s.arrival, s.seq_id))
            ordered += resuming + self._shortest_where_harmless(on_time, now, rate, need_of) + late
            queued += sum(need_of(s) for s in resuming)
        return ordered

    def _mark_late(self, seq: Sequence, late: list[Sequence]) -> None:
        seq.late = True
        if self.reject_late:
            self.rejected.append(seq)
            self.rejected_late += 1
        else:
            self.demoted_late += 1
            late.append(seq)

    @staticmethod
    def _shortest_where_harmless(on_time: list[Sequence], now: float, rate: float,
                                 need: Callable[[Sequence], int]) -> list[Sequence]:
        """`on_time` (least slack first, every one feasible in that order), with a shorter request
        moved ahead of longer ones wherever each request it overtakes still makes its deadline."""
        head, rest = on_time[:REORDER_WINDOW], on_time[REORDER_WINDOW:]
        done = 0.0  # prefill queued ahead of head[0]; each request's finish is relative to it
        result: list[Sequence] = []
        while head:
            finishes, t = [], done
            for seq in head:
                t += need(seq) / rate
                finishes.append(t)
            best = 0
            for j in range(1, len(head)):
                if need(head[j]) >= need(head[best]):
                    continue
                # head[j] first delays head[:j] by its own prefill time.
                delay = need(head[j]) / rate
                if all(now + finishes[i] + delay <= head[i].ttft_deadline for i in range(j)):
                    best = j
            chosen = head.pop(best)
            done += need(chosen) / rate
            result.append(chosen)
        return result + rest

    def retry_after_s(self, scheduler: Scheduler, rate: float) -> int:
        """When a refused request could hope for its TTFT: the prefill queued now, cleared."""
        queued = sum(s.num_uncomputed_tokens for s in scheduler.running if s.first_token_time is None)
        queued += sum(len(s) for s in scheduler.waiting if not s.late)
        return max(1, math.ceil(queued / rate)) if rate > 0 else 1

    def on_admitted(self, seq: Sequence, now: float, need: int, rate: float) -> None:
        """A request's first admission: its slack then, for the histogram."""
        if seq.ttft_deadline is not None:
            self.slack.observe(seq.ttft_deadline - now - need / rate)
