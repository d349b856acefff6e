"""BlockManager: exact allocation, reference counts, hash chaining, prefix hits and eviction."""

from __future__ import annotations

import pytest

from runtime.engine.block_manager import ROOT_HASH, BlockManager, chain_hash
from runtime.engine.sequence import Sequence


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Allocate and 'compute' the first num_tokens (default all) tokens of seq."""
    num_tokens = len(seq) if num_tokens is None else num_tokens
    bm.allocate_slots(seq, num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    bm.register_computed_blocks(seq)
    return seq


def admit(bm: BlockManager, seq: Sequence) -> int:
    return bm.allocate_prefix(seq, bm.find_cached_prefix(seq))


def test_allocation_takes_ceil_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(10)))
    assert bm.num_new_blocks_needed(seq, 10) == 3
    bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert [bm.blocks[b].ref_count for b in seq.block_table] == [1, 1, 1]
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and bm.usage == 0.0


def test_can_allocate_and_may_append_boundaries():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence("a", list(range(7)))
    assert bm.can_allocate(seq, 8) and not bm.can_allocate(seq, 9)
    computed(bm, seq)  # 7 tokens in 2 blocks: one free slot left in the last block
    assert bm.may_append(seq)
    seq.append_token(7)
    computed(bm, seq)
    seq.append_token(8)
    assert not bm.may_append(seq)  # the 9th token would need a third block
    assert bm.max_tokens_allocatable(seq) == 0
    with pytest.raises(RuntimeError):
        bm.allocate_slots(seq, 1)


def test_full_computed_blocks_are_hashed_as_a_chain():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = computed(bm, Sequence("a", list(range(10))))
    h0 = chain_hash(ROOT_HASH, [0, 1, 2, 3])
    h1 = chain_hash(h0, [4, 5, 6, 7])
    assert bm.blocks[seq.block_table[0]].hash == h0
    assert bm.blocks[seq.block_table[1]].hash == h1
    assert bm.blocks[seq.block_table[2]].hash is None  # partial block is never shared
    assert bm.cached_block_ids == {h0: seq.block_table[0], h1: seq.block_table[1]}
    # Same second block content after a different first block: a different hash.
    assert chain_hash(chain_hash(ROOT_HASH, [9, 9, 9, 9]), [4, 5, 6, 7]) != h1


def test_blocks_are_hashed_only_once_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(12)))
    bm.allocate_slots(seq, 12)
    seq.num_computed_tokens = 6  # first chunk done, second block half computed
    bm.register_computed_blocks(seq)
    assert len(bm.cached_block_ids) == 1
    other = Sequence("b", list(range(12)))
    assert bm.find_cached_prefix(other) == [seq.block_table[0]]


def test_prefix_hit_shares_blocks_by_reference_count():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = computed(bm, Sequence("a", list(range(10))))
    second = Sequence("b", list(range(8)) + [50, 51, 52])
    assert admit(bm, second) == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    computed(bm, second)
    assert second.block_table[2] not in first.block_table
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]


def test_prefix_hit_always_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, Sequence("a", list(range(8))))
    again = Sequence("b", list(range(8)))
    # Both blocks are cached, but the last one is recomputed to get the next token's logits.
    assert admit(bm, again) == 4
    assert again.num_uncomputed_tokens == 4


def test_freed_hashed_blocks_stay_reusable_until_evicted():
    bm = BlockManager(num_blocks=3, block_size=4)
    first = computed(bm, Sequence("a", list(range(9))))
    bm.free(first)
    assert bm.num_free_blocks == 3
    assert len(bm.cached_block_ids) == 2
    second = Sequence("b", list(range(9)))
    assert admit(bm, second) == 8
    assert bm.num_free_blocks == 1  # the two cached blocks were taken out of the free list
    assert [bm.blocks[b].ref_count for b in second.block_table] == [1, 1]


def test_eviction_is_least_recently_freed_first_and_drops_the_hash():
    bm = BlockManager(num_blocks=4, block_size=2)
    old = computed(bm, Sequence("old", [1, 2, 3, 4]))
    new = computed(bm, Sequence("new", [5, 6, 7, 8]))
    old_blocks = list(old.block_table)
    bm.free(old)
    bm.free(new)
    # Four cached free blocks; allocating two must evict the older request's blocks.
    third = Sequence("third", [9, 9, 9])
    bm.allocate_slots(third, 3)
    assert set(third.block_table) == set(old_blocks)
    assert bm.find_cached_prefix(Sequence("x", [1, 2, 3, 4, 0])) == []
    assert len(bm.find_cached_prefix(Sequence("y", [5, 6, 7, 8, 0]))) == 2


def test_unhashed_blocks_are_evicted_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=2)
    cached = computed(bm, Sequence("cached", [1, 2, 3]))  # one full hashed block + a partial
    cached_block = cached.block_table[0]
    bm.free(cached)
    taker = Sequence("t", [7, 7, 7, 7])
    bm.allocate_slots(taker, 4)
    assert cached_block not in taker.block_table
    assert len(bm.find_cached_prefix(Sequence("again", [1, 2, 3]))) == 1


def test_duplicate_content_keeps_the_first_block_canonical():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Sequence("a", [1, 2, 3])
    b = Sequence("b", [1, 2, 3])
    bm.allocate_slots(a, 3)
    bm.allocate_slots(b, 3)  # both computed in the same step, neither could hit the other
    for seq in (a, b):
        seq.num_computed_tokens = 3
        bm.register_computed_blocks(seq)
    assert bm.cached_block_ids[bm.blocks[a.block_table[0]].hash] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 6


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(bm, Sequence("a", list(range(10))))
    assert bm.cached_block_ids == {}
    assert bm.find_cached_prefix(Sequence("b", list(range(10)))) == []


def test_cached_free_blocks_count_against_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.free(computed(bm, Sequence("a", [1, 2, 3, 4, 5])))
    seq = Sequence("b", [1, 2, 3, 4, 5])
    cached = bm.find_cached_prefix(seq)
    assert len(cached) == 2
    assert bm.num_free_needed_for_prefix(cached) == 2
