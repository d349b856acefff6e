"""KV-cache blocks: allocation, reference counts and the prefix cache. Pure Python, no torch.

A block holds the keys/values of `block_size` consecutive tokens of one sequence. Once a block
is full and its KV computed, it is named by a hash chained over every token before it, so two
sequences with the same prefix can share it (reference counted). A block whose last user left
goes to the back of the free list but keeps its hash: a later request with the same prefix
takes it back instead of recomputing, and allocation evicts from the front (least recently
freed first).
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.engine.sequence import Sequence

ROOT_HASH = -1  # the "previous block" hash of a sequence's first block


def chain_hash(prev_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    return hash((prev_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the front is the least recently freed block.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # chain hash -> block id
        # Hashes of each sequence's full, computed blocks, in block-table order.
        self._seq_hashes: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`.

        At least one token is always left out so the model has something to run and the
        sequence gets logits for its next token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        found: list[int] = []
        prev_hash = ROOT_HASH
        for i in range(max_blocks):
            start = i * self.block_size
            prev_hash = chain_hash(prev_hash, seq.token_ids[start : start + self.block_size])
            block_id = self.cached_block_ids.get(prev_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_free_needed_for_prefix(self, cached_block_ids: list[int]) -> int:
        """Cached blocks nobody references sit in the free list; taking them uses it up."""
        return sum(1 for b in cached_block_ids if self.blocks[b].ref_count == 0)

    def allocate_prefix(self, seq: Sequence, cached_block_ids: list[int]) -> int:
        """Give `seq` (which holds no blocks) the cached blocks; return the tokens they cover."""
        assert not seq.block_table, "prefix must be allocated before any other block"
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = list(cached_block_ids)
        self._seq_hashes[seq.seq_id] = [self.blocks[b].hash for b in cached_block_ids]
        seq.num_computed_tokens = len(cached_block_ids) * self.block_size
        return seq.num_computed_tokens

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Name the blocks of `seq` that became full and computed so others can share them."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching:
            return
        prev_hash = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full):
            start = i * self.block_size
            prev_hash = chain_hash(prev_hash, seq.token_ids[start : start + self.block_size])
            hashes.append(prev_hash)
            block = self.blocks[seq.block_table[i]]
            # Two sequences may compute the same content in the same step; the first one
            # registered stays canonical and the duplicate is freed as an ordinary block.
            if prev_hash not in self.cached_block_ids:
                self.cached_block_ids[prev_hash] = block.block_id
                block.hash = prev_hash

    # -- allocation -----------------------------------------------------------------------------

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def max_tokens_allocatable(self, seq: Sequence) -> int:
        """How many more tokens of `seq` fit into its blocks plus every free block."""
        capacity = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def may_append(self, seq: Sequence) -> bool:
        """Whether one more token (a decode step) fits."""
        return self.can_allocate(seq, 1)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.num_new_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"need {needed} blocks, only {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Evicting: the content is about to be overwritten.
            if self.cached_block_ids.get(block.hash) == block_id:
                del self.cached_block_ids[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks go first so they are evicted before the shared
        head of a prefix."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    # Unnamed content can never be hit: evict it before any cached block.
                    self.free_block_ids[block_id] = None
                    self.free_block_ids.move_to_end(block_id, last=False)
                else:
                    self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seq_hashes.pop(seq.seq_id, None)
