"""SLO scheduling (runtime/engine/slo_scheduling.py) in simulated time: the scheduler alone, a fake
clock, and steps that take what a linear cost model says. No model runs, so deadlines met and
missed are exact and the same on every machine."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from runtime.engine.block_manager import BlockManager
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import Sequence
from runtime.engine.slo_scheduling import SloTargets, StepCostModel

TTFT_S, TPOT_S = 2.0, 0.2
FIXED_S, PER_TOKEN_S = 0.02, 0.0015  # about the small demo model's steps on two cores


@dataclass
class Arrival:
    at: float
    prompt: int
    output: int
    priority: int = 0
    first_token: int = 1000  # distinct prompts by default (no prefix cache hits)


@dataclass
class Outcome:
    arrival: Arrival
    ttft: float | None = None
    tpot: float | None = None
    rejected: bool = False

    @property
    def good(self) -> bool:
        return (self.ttft is not None and self.ttft <= TTFT_S
                and (self.tpot is None or self.tpot <= TPOT_S))


class Simulation:
    """Runs arrivals through a Scheduler: each step advances the clock by the cost model's time."""

    def __init__(self, policy: str, reject_late: bool = False, budget: int = 2048,
                 num_blocks: int = 4096, max_num_seqs: int = 128) -> None:
        self.now = 0.0
        self.scheduler = Scheduler(BlockManager(num_blocks, 16, True), max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=budget, policy=policy,
                                   reject_late=reject_late, clock=lambda: self.now)
        self.preemptions_seen = 0

    def run(self, arrivals: list[Arrival], targets=SloTargets(TTFT_S, TPOT_S)) -> list[Outcome]:
        outcomes = {}
        pending = sorted(enumerate(arrivals), key=lambda p: p[1].at)
        seqs: dict[str, tuple[Sequence, Arrival]] = {}
        while pending or self.scheduler.has_unfinished():
            while pending and pending[0][1].at <= self.now:
                i, a = pending.pop(0)
                seq = Sequence(str(i), list(range(a.first_token, a.first_token + a.prompt)), priority=a.priority,
                               arrival=i, max_tokens=a.output, arrival_time=a.at,
                               ttft_deadline=a.at + targets.ttft_s, tpot_target=targets.tpot_s)
                seqs[str(i)] = (seq, a)
                outcomes[str(i)] = Outcome(a)
                self.scheduler.add(seq)
            out = self.scheduler.schedule()
            for seq in out.rejected:
                outcomes[seq.request_id].rejected = True
                assert out.retry_after_s >= 1
            if out.is_empty:
                if pending:
                    self.now = max(self.now, pending[0][1].at)
                continue
            seconds = FIXED_S + PER_TOKEN_S * out.num_batched_tokens
            self.now += seconds
            self.scheduler.on_chunks_computed(out, seconds)
            for chunk in out.chunks:
                if not chunk.completes_sequence:
                    continue
                seq, a = seqs[chunk.seq.request_id]
                seq.append_token(7, self.now)
                outcome = outcomes[seq.request_id]
                if outcome.ttft is None:
                    outcome.ttft = self.now - a.at
                if seq.num_output_tokens >= a.output:
                    if a.output > 1:
                        outcome.tpot = (self.now - seq.first_token_time) / (a.output - 1)
                    self.scheduler.finish(seq, "length")
            self.preemptions_seen = self.scheduler.counters.num_preemptions
        return list(outcomes.values())


def poisson(rate: float, count: int, seed: int, prompt=(32, 512), output=(16, 256)) -> list[Arrival]:
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(count):
        t += rng.expovariate(rate)
        arrivals.append(Arrival(t, rng.randint(*prompt), rng.randint(*output), first_token=1000 + 600 * i))
    return arrivals


def good(outcomes: list[Outcome]) -> int:
    return sum(o.good for o in outcomes)


def capacity_rps() -> float:
    """Requests a second the simulated machine completes on the default mix, run flat out."""
    sim = Simulation("fcfs")
    arrivals = [Arrival(0.0, a.prompt, a.output, first_token=a.first_token) for a in poisson(1.0, 60, seed=1)]
    sim.run(arrivals)
    return 60 / sim.now


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slo_meets_more_deadlines_than_fcfs_on_the_same_overload(seed):
    rate = 1.5 * capacity_rps()
    arrivals = poisson(rate, 150, seed)
    fcfs = Simulation("fcfs").run(arrivals)
    slo = Simulation("slo").run(arrivals)
    rejecting = Simulation("slo", reject_late=True).run(arrivals)
    assert good(slo) > 2 * good(fcfs)
    assert good(rejecting) >= good(slo) * 0.9
    served = [o for o in rejecting if not o.rejected]
    assert sum(o.rejected for o in rejecting) > 0
    assert good(served) >= 0.8 * len(served)
    # Serving late ones last still serves everyone.
    assert all(o.ttft is not None for o in slo)


def test_below_saturation_slo_keeps_what_fcfs_keeps():
    arrivals = poisson(0.6 * capacity_rps(), 80, seed=5)
    assert good(Simulation("slo").run(arrivals)) >= good(Simulation("fcfs").run(arrivals)) - 2


def test_a_request_that_cannot_make_its_ttft_is_refused_at_once():
    sim = Simulation("slo", reject_late=True)
    # 20 long prompts at once: the machine prefills ~600 tokens a second, so those behind the
    # first few cannot have their first token within 2 s.
    arrivals = [Arrival(0.0, 500, 20, first_token=1000 + 600 * i) for i in range(20)]
    outcomes = sim.run(arrivals)
    rejected = [o for o in outcomes if o.rejected]
    assert rejected and len(rejected) < 20
    assert all(o.ttft is None for o in rejected)
    assert all(o.ttft <= TTFT_S for o in outcomes if not o.rejected)
    assert sim.scheduler.slo.rejected_late == len(rejected)
    assert all(s.finish_reason != "late" for s in sim.scheduler.running)


def test_late_requests_are_served_after_those_that_can_still_make_it():
    sim = Simulation("slo")
    hopeless = [Arrival(0.0, 500, 4, first_token=1000 + 600 * i) for i in range(12)]
    later = [Arrival(3.0 + 0.5 * i, 64, 4, first_token=20000 + 100 * i) for i in range(4)]
    outcomes = sim.run(hopeless + later)
    assert all(o.good for o in outcomes[12:]), [o.ttft for o in outcomes[12:]]
    assert sim.scheduler.slo.demoted_late > 0
    assert all(o.ttft is not None for o in outcomes)


def test_step_budget_keeps_decoding_streams_within_their_tpot():
    sim = Simulation("slo", budget=2048)
    # Streams decoding, then a long prompt arrives: fcfs would prefill it in one 2,048-token step
    # (3 s); slo chunks it so every step stays inside the streams' TPOT.
    streams = [Arrival(0.0, 32, 12, first_token=1000 + 50 * i) for i in range(8)]
    long_prompt = [Arrival(0.2, 1900, 2, first_token=50000)]
    outcomes = sim.run(streams + long_prompt)
    assert all(o.tpot <= TPOT_S for o in outcomes[:8]), [o.tpot for o in outcomes[:8]]
    fcfs = Simulation("fcfs").run(streams + long_prompt)
    assert any(o.tpot > TPOT_S for o in fcfs[:8])


def test_the_step_budget_follows_the_tightest_credit():
    sim = Simulation("slo", budget=2048)
    scheduler = sim.scheduler
    a = Sequence("a", list(range(100, 140)), max_tokens=50, arrival_time=0.0, ttft_deadline=2.0, tpot_target=0.1)
    scheduler.add(a)
    scheduler.on_chunks_computed(scheduler.schedule())
    a.append_token(7, sim.now)  # first token at t=0
    sim.now = 0.1 * 1  # exactly on target: no credit left beyond the margin
    plan = scheduler.slo.plan(scheduler, sim.now)
    cost = scheduler.slo.cost
    assert plan.budget == cost.tokens_within(0.9 * 0.1)
    for _ in range(4):  # five tokens by t=0.1: well ahead, it may take a longer step, up to 2.5x its target
        a.append_token(7, sim.now)
    assert scheduler.slo.plan(scheduler, sim.now).budget == min(cost.tokens_within(0.25), 2048)
    sim.now = 0.45  # five tokens by 0.45 s: its credit (0.5 s, less 0.45 and a 0.01 s reserve) is 0.04 s
    assert scheduler.slo.plan(scheduler, sim.now).budget == cost.tokens_within(0.9 * 0.1)


def test_higher_priority_class_goes_first_even_with_more_slack():
    sim = Simulation("slo", budget=64, max_num_seqs=1)
    scheduler = sim.scheduler
    low = Sequence("low", list(range(100, 132)), priority=0, arrival=0, arrival_time=0.0, ttft_deadline=0.5,
                   tpot_target=0.2)
    high = Sequence("high", list(range(200, 232)), priority=5, arrival=1, arrival_time=0.0, ttft_deadline=5.0,
                    tpot_target=0.2)
    scheduler.add(low)
    scheduler.add(high)
    out = scheduler.schedule()
    assert [c.seq.request_id for c in out.prefills] == ["high"]


def test_least_slack_first_within_a_class():
    sim = Simulation("slo", budget=32, max_num_seqs=1)
    scheduler = sim.scheduler
    relaxed = Sequence("relaxed", list(range(100, 132)), arrival=0, arrival_time=0.0, ttft_deadline=10.0,
                       tpot_target=0.2)
    urgent = Sequence("urgent", list(range(200, 232)), arrival=1, arrival_time=0.0, ttft_deadline=1.0,
                      tpot_target=0.2)
    scheduler.add(relaxed)
    scheduler.add(urgent)
    assert [c.seq.request_id for c in scheduler.schedule().prefills] == ["urgent"]


def test_a_short_job_overtakes_only_where_no_one_loses_their_deadline():
    def first_admitted(deadline_of_long: float) -> str:
        sim = Simulation("slo", budget=16, max_num_seqs=1)
        scheduler = sim.scheduler
        scheduler.add(Sequence("long", list(range(100, 400)), arrival=0, arrival_time=0.0,
                               ttft_deadline=deadline_of_long, tpot_target=0.2))
        scheduler.add(Sequence("short", list(range(500, 516)), arrival=1, arrival_time=0.0, ttft_deadline=30.0,
                               tpot_target=0.2))
        return scheduler.schedule().prefills[0].seq.request_id

    # Least slack is "long" both times; "short" goes first only where "long" still makes it.
    assert first_admitted(deadline_of_long=20.0) == "short"
    scheduler = Simulation("slo", budget=16, max_num_seqs=1).scheduler
    rate = scheduler.slo.plan(scheduler, 0.0).prefill_rate  # the planner's prefill speed estimate
    assert first_admitted(deadline_of_long=(300 + 8) / rate) == "long"  # alone it makes it, after short not


def test_fcfs_ignores_priorities_and_priority_keeps_them():
    for policy, expected in (("fcfs", "first"), ("priority", "urgent")):
        scheduler = Scheduler(BlockManager(64, 4, True), max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
        scheduler.add(Sequence("first", list(range(100, 108)), priority=0, arrival=0))
        scheduler.add(Sequence("urgent", list(range(200, 208)), priority=9, arrival=1))
        assert scheduler.schedule().prefills[0].seq.request_id == expected


def test_step_cost_model_learns_the_machine():
    model = StepCostModel()
    for tokens in (1, 8, 64, 128, 256, 512, 1024) * 20:
        model.observe(tokens, 0.05 + 0.0004 * tokens)
    assert model.seconds(600) == pytest.approx(0.05 + 0.0004 * 600, rel=0.05)
    assert model.tokens_within(0.45) == pytest.approx(1000, rel=0.05)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority, slo"):
        Scheduler(BlockManager(8, 4, True), max_num_seqs=1, max_num_batched_tokens=8, policy="edf")


def test_streams_already_answering_are_never_refused():
    """A preempted stream, or a sibling choice (n > 1) released after its request's first token,
    has no TTFT left to meet: it resumes, even long past the request's deadline."""
    sim = Simulation("slo", reject_late=True)
    scheduler = sim.scheduler
    sibling = Sequence("r", list(range(100, 140)), index=1, arrival_time=0.0, ttft_deadline=None, tpot_target=0.2)
    preempted = Sequence("p", list(range(200, 240)), arrival_time=0.0, ttft_deadline=2.0, tpot_target=0.2)
    preempted.append_token(7, 0.5)
    sim.now = 100.0
    scheduler.add(sibling)
    scheduler.add(preempted)
    out = scheduler.schedule()
    assert not out.rejected
    assert {c.seq.request_id for c in out.prefills} == {"r", "p"}


def test_a_step_model_that_misjudges_the_machine_still_serves_and_learns():
    """A model that thinks the machine 20x slower than it is would refuse every request forever
    (nothing runs, so nothing corrects it): a request with nothing ahead of it is always served."""
    sim = Simulation("slo", reject_late=True)
    sim.scheduler.slo.cost = StepCostModel(fixed_s=0.4, per_token_s=0.03)
    arrivals = [Arrival(0.5 * i, 200, 20, first_token=1000 + 600 * i) for i in range(40)]
    outcomes = sim.run(arrivals)
    assert not outcomes[0].rejected
    assert sum(o.good for o in outcomes) >= 35, [(o.rejected, o.ttft) for o in outcomes]
    assert sim.scheduler.slo.cost.per_token_s == pytest.approx(PER_TOKEN_S, rel=0.1)


def test_a_request_alone_is_refused_only_once_its_deadline_has_passed():
    sim = Simulation("slo", reject_late=True)
    scheduler = sim.scheduler
    scheduler.slo.cost = StepCostModel(fixed_s=5.0, per_token_s=1.0)  # says nothing can make it
    hopeful = Sequence("hopeful", list(range(100, 400)), arrival_time=0.0, ttft_deadline=2.0, tpot_target=0.2)
    scheduler.add(hopeful)
    assert not scheduler.schedule().rejected
    scheduler.finish(hopeful, "abort")
    sim.now = 3.0
    scheduler.add(Sequence("past", list(range(500, 520)), arrival_time=0.0, ttft_deadline=2.0, tpot_target=0.2))
    assert [s.request_id for s in scheduler.schedule().rejected] == ["past"]


def test_a_burst_keeps_steps_short_enough_for_later_arrivals():
    """100 requests arriving over 50 ms: without a cap the first would be prefilled in one long step
    and later arrivals would have lost much of their TTFT by then. The machine prefills ~650 tokens a
    second, so about five of these 270-token prompts can have their first token within 2 s."""
    arrivals = [Arrival(0.0005 * i, 270, 60, first_token=1000 + 600 * i) for i in range(100)]
    sim = Simulation("slo", reject_late=True)
    outcomes = sim.run(arrivals)
    served = [o for o in outcomes if not o.rejected]
    assert len(served) >= 4 and all(o.good for o in served), [(o.ttft, o.tpot) for o in served]
