"""Scheduler: token budget, decode-first, chunked prefill, priorities, preemption, abort."""

from __future__ import annotations

from runtime.engine.block_manager import BlockManager
from runtime.engine.scheduler import Scheduler, SchedulerOutput
from runtime.engine.sequence import Sequence, SequenceStatus

NEXT_TOKEN = 7


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, prefix=True,
                   prefill_cap=None):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_prefill_tokens_with_decodes=prefill_cap)


def seq(request_id: str, prompt_len: int, priority: int = 0, arrival: int = 0, first=100):
    return Sequence(
        request_id, list(range(first, first + prompt_len)), priority=priority, arrival=arrival
    )


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, pretend the model ran, append a token to every sequence that completed."""
    out = scheduler.schedule()
    scheduler.on_chunks_computed(out)
    for chunk in out.chunks:
        if chunk.completes_sequence:
            chunk.seq.append_token(NEXT_TOKEN)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_long_prompt_is_split_into_chunks_within_the_budget():
    s = make_scheduler(budget=4)
    a = seq("a", 10)
    s.add(a)
    assert plan(run_step(s)) == [("a", 0, 4)]
    assert plan(run_step(s)) == [("a", 4, 4)]
    last = run_step(s)
    assert plan(last) == [("a", 8, 2)] and last.chunks[0].completes_sequence
    assert len(a) == 11
    assert plan(run_step(s)) == [("a", 10, 1)]  # now a decode


def test_decodes_go_first_and_prefill_fills_the_rest_of_the_budget():
    s = make_scheduler(budget=6)
    a, b = seq("a", 3, arrival=0), seq("b", 3, arrival=1)
    s.add(a)
    s.add(b)
    run_step(s)  # both prompts fit: 3 + 3
    c = seq("c", 20, arrival=2)
    s.add(c)
    out = run_step(s)
    assert plan(out) == [("a", 3, 1), ("b", 3, 1), ("c", 0, 4)]
    assert out.num_batched_tokens == 6
    assert [x.seq.request_id for x in out.decodes] == ["a", "b"]


def test_prefill_cap_applies_only_while_decodes_run():
    s = make_scheduler(budget=12, prefill_cap=3)
    a = seq("a", 10)
    s.add(a)
    assert plan(run_step(s)) == [("a", 0, 10)]  # no decodes yet: the whole budget
    b, c = seq("b", 20, arrival=1, first=500), seq("c", 5, arrival=2, first=900)
    s.add(b)
    s.add(c)
    assert plan(run_step(s)) == [("a", 10, 1), ("b", 0, 3)]  # a decodes: prefills get 3
    assert plan(run_step(s)) == [("a", 11, 1), ("b", 3, 3)]


def test_budget_is_never_exceeded_and_waiting_admission_stops_when_spent():
    s = make_scheduler(budget=5)
    for i in range(4):
        s.add(seq(f"r{i}", 3, arrival=i))
    out = run_step(s)
    assert plan(out) == [("r0", 0, 3), ("r1", 0, 2)]
    assert [x.request_id for x in s.waiting] == ["r2", "r3"]
    for _ in range(20):
        assert run_step(s).num_batched_tokens <= 5


def test_priority_first_then_first_come_first_served():
    s = make_scheduler(max_num_seqs=1, budget=64)
    s.add(seq("low-old", 2, priority=0, arrival=0))
    s.add(seq("high-new", 2, priority=5, arrival=1))
    s.add(seq("high-newer", 2, priority=5, arrival=2))
    s.add(seq("low-new", 2, priority=0, arrival=3))
    assert [x.request_id for x in s.waiting] == ["high-new", "high-newer", "low-old", "low-new"]
    assert plan(run_step(s)) == [("high-new", 0, 2)]
    assert len(s.running) == 1  # max_num_seqs holds the others back


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add(seq(f"r{i}", 2, arrival=i))
    run_step(s)
    assert [x.request_id for x in s.running] == ["r0", "r1"]
    assert [x.request_id for x in s.waiting] == ["r2"]


def test_out_of_blocks_preempts_lowest_priority_newest_running():
    # 4 blocks of 2 tokens; three sequences of 2 prompt tokens each hold one block.
    s = make_scheduler(num_blocks=4, block_size=2, budget=64, prefix=False)
    vip = seq("vip", 2, priority=1, arrival=2, first=10)
    old = seq("old", 2, priority=0, arrival=0, first=20)
    new = seq("new", 2, priority=0, arrival=1, first=30)
    for x in (old, new, vip):
        s.add(x)
    run_step(s)  # prefill all three (3 blocks), each now has 3 tokens
    out = run_step(s)
    # Decodes need a second block each: vip takes the last free one, then "new" (lowest
    # priority, newest) is preempted so "old" can go on.
    assert plan(out) == [("vip", 2, 1), ("old", 2, 1)]
    assert out.preempted == [new]
    assert new.status is SequenceStatus.WAITING and new.block_table == []
    assert new.num_computed_tokens == 0 and len(new) == 3  # its sampled token is kept
    assert s.counters.num_preemptions == 1


def test_a_sequence_preempts_itself_when_it_is_the_lowest():
    s = make_scheduler(num_blocks=2, block_size=2, budget=64, prefix=False)
    high = seq("high", 2, priority=3, arrival=1, first=10)
    low = seq("low", 2, priority=0, arrival=0, first=20)
    s.add(low)
    s.add(high)
    run_step(s)
    out = run_step(s)  # high decodes into... no free block: low (lowest) is preempted
    assert plan(out) == [("high", 2, 1)]
    assert out.preempted == [low]


def test_preempted_sequence_is_recomputed_with_its_output_and_every_request_finishes():
    s = make_scheduler(num_blocks=6, block_size=2, budget=8, prefix=False)
    seqs = [seq(f"r{i}", 3, arrival=i, first=10 * i) for i in range(4)]
    for x in seqs:
        s.add(x)
    finished = []
    for _ in range(200):
        run_step(s)
        for x in list(s.running):
            if x.num_output_tokens >= 5:
                s.finish(x, "length")
                finished.append(x)
        if not s.has_unfinished():
            break
    assert sorted(x.request_id for x in finished) == ["r0", "r1", "r2", "r3"]
    assert s.counters.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 6


def test_recompute_after_preemption_runs_prompt_plus_output():
    s = make_scheduler(num_blocks=8, block_size=2, budget=64, prefix=False)
    a = seq("a", 3)
    s.add(a)
    run_step(s)
    run_step(s)  # a: 3 prompt + 2 output tokens, 4 computed
    s._preempt(a, SchedulerOutput())
    out = run_step(s)
    assert plan(out) == [("a", 0, 5)]  # all five tokens again, then it samples
    assert out.chunks[0].completes_sequence


def test_prefix_cache_hit_on_admission_counts_tokens():
    s = make_scheduler(block_size=4, budget=64)
    first = seq("first", 10)
    s.add(first)
    run_step(s)
    s.finish(first, "length")
    again = seq("again", 10)
    s.add(again)
    out = run_step(s)
    assert plan(out) == [("again", 8, 2)]
    assert again.num_cached_tokens == 8
    assert s.counters.prefix_cache_queries == 20
    assert s.counters.prefix_cache_hits == 8


def test_waiting_head_that_does_not_fit_blocks_later_ones():
    s = make_scheduler(num_blocks=3, block_size=2, budget=64, prefix=False)
    s.add(seq("holder", 4, arrival=0))
    run_step(s)  # holder: 2 blocks (+1 token -> needs a 3rd at its next decode)
    s.add(seq("big", 4, arrival=1))
    s.add(seq("small", 1, arrival=2))
    out = run_step(s)
    # holder's decode takes the last block; big gets nothing, and small may not overtake it.
    assert plan(out) == [("holder", 4, 1)]
    assert [x.request_id for x in s.waiting] == ["big", "small"]


def test_admission_shrinks_the_first_chunk_to_the_free_blocks():
    s = make_scheduler(num_blocks=3, block_size=2, budget=64, prefix=False)
    a = seq("a", 10)
    s.add(a)
    out = run_step(s)
    assert plan(out) == [("a", 0, 6)]
    assert s.block_manager.num_free_blocks == 0


def test_abort_frees_blocks_and_removes_the_request_everywhere():
    s = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=1)
    running, waiting = seq("x", 5, arrival=0), seq("y", 3, arrival=1)
    s.add(running)
    s.add(waiting)
    run_step(s)
    assert s.block_manager.num_free_blocks == 5
    assert s.abort("x") == [running]
    assert running.status is SequenceStatus.FINISHED and running.finish_reason == "abort"
    assert s.block_manager.num_free_blocks == 8
    assert s.abort("y") == [waiting]
    assert not s.has_unfinished()
    assert s.abort("nope") == []


# -- background work (the lowest priority: eval runs) ------------------------------------------

def make_background_scheduler(budget=32, per_step=4, **kwargs):
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=budget, background_priority=-1000,
                     background_tokens_per_step=per_step, **kwargs)


def test_background_alone_takes_the_whole_step():
    s = make_background_scheduler()
    s.add(seq("eval", 20, priority=-1000))
    assert plan(run_step(s)) == [("eval", 0, 20)]


def test_background_shares_a_few_tokens_while_foreground_runs_or_waits():
    s = make_background_scheduler(budget=32, per_step=4)
    s.add(seq("eval-1", 20, priority=-1000, arrival=0))
    s.add(seq("eval-2", 20, priority=-1000, arrival=1, first=300))
    s.add(seq("chat", 10, priority=0, arrival=2, first=500))
    # The foreground prompt goes first and whole; the background ones get 4 tokens between them.
    assert plan(run_step(s)) == [("chat", 0, 10), ("eval-1", 0, 4)]
    # chat decodes; eval-1 continues within the allowance; eval-2 still waits.
    assert plan(run_step(s)) == [("chat", 10, 1), ("eval-1", 4, 4)]


def test_background_takes_the_step_again_once_foreground_finishes():
    s = make_background_scheduler(budget=32, per_step=4)
    chat, work = seq("chat", 4, priority=0, arrival=0), seq("eval", 20, priority=-1000, arrival=1, first=300)
    s.add(chat)
    s.add(work)
    assert plan(run_step(s)) == [("chat", 0, 4), ("eval", 0, 4)]
    s.finish(chat, "stop")
    assert plan(run_step(s)) == [("eval", 4, 16)]


def test_without_a_background_priority_the_lowest_priority_competes_for_the_whole_step():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    s.add(seq("chat", 10, priority=0, arrival=0))
    s.add(seq("eval", 20, priority=-1000, arrival=1, first=300))
    assert plan(run_step(s)) == [("chat", 0, 10), ("eval", 0, 20)]


def test_a_foreground_request_preempts_background_work_for_a_slot():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32, background_priority=-1000,
                  background_tokens_per_step=32)
    s.add(seq("batch-1", 4, priority=-1000, arrival=0))
    s.add(seq("batch-2", 4, priority=-1000, arrival=1, first=300))
    run_step(s)  # both background lines fill the two slots
    s.add(seq("chat", 4, priority=0, arrival=2, first=500))
    out = run_step(s)
    # The newest background line gives up its slot (it waits to be recomputed); chat starts at once.
    assert [p.request_id for p in out.preempted] == ["batch-2"]
    assert ("chat", 0, 4) in plan(out)
    assert {q.request_id for q in s.running} == {"batch-1", "chat"}


def test_a_foreground_request_preempts_background_work_for_blocks():
    bm = BlockManager(4, 4, enable_prefix_caching=False)  # 16 tokens of KV in all
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32, background_priority=-1000,
                  background_tokens_per_step=32)
    s.add(seq("batch", 15, priority=-1000, arrival=0))
    run_step(s)  # the background prompt holds all four blocks
    s.add(seq("chat", 4, priority=0, arrival=1, first=500))
    out = run_step(s)
    assert [p.request_id for p in out.preempted] == ["batch"]
    assert ("chat", 0, 4) in plan(out)


def test_background_work_never_preempts_background_work_for_a_slot():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=32, background_priority=-1000)
    s.add(seq("batch-1", 4, priority=-1000, arrival=0))
    run_step(s)
    s.add(seq("batch-2", 4, priority=-1000, arrival=1, first=300))
    out = run_step(s)
    assert out.preempted == [] and [q.request_id for q in s.running] == ["batch-1"]
