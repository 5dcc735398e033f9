"""KV block allocator: a free list with ref counts, plus an optional prefix cache of full blocks.

Blocks are allocated lazily: a sequence's block table grows as its chunks and decode tokens are
scheduled (`grow`). Policies that must never preempt (orca, faster_transformer) simply ask `grow` for the
sequence's whole final length at admission.

Prefix caching: a full, computed block is named by a chained hash of (parent block's hash, its tokens),
so a hash stands for the whole prefix up to the block's end. The hash is SHA-256: with Python's hash() a
client could craft a prompt whose blocks collide with another's and be served its KV (vLLM's CVE-2025-25183).
When a sequence is admitted it takes the cached blocks of its longest cached prefix (ref count + 1) and skips
computing them, but always leaves at least its last token to compute, so there are logits to sample. A cached
block whose ref count drops to 0 stays findable in an LRU list and is evicted only when the free list runs
dry. Queries and hits are counted in tokens: each admission queries all its tokens and hits the ones it
reuses.

Parallel sampling (n > 1): the n choices of a request share its prompt's blocks (`fork`, ref count + 1
each), computed once. Full blocks are immutable; the partial last block is copied when a choice first
writes into it while another still holds it (`grow` allocates the copy and queues the (source,
destination) pair in `pending_copies`, which the engine runs on the backend before the step's forward,
when every block still holds what it held at scheduling). A pending source whose last holder leaves stays
off the free list until `take_copies`, so no block is both a source and a destination of one step's copies
(they run in parallel).

A sliding window over every layer (`window`): a block no query to come can see goes back, its entry -1 (the
kernels read only the window's keys); a cached one stays findable, KV intact, until evicted (still exact).

Every admitted sequence also owns a row of `tables`, a matrix that mirrors its block table (zero-padded), so
the batch builder takes a step's block tables with one NumPy gather instead of converting lists every step.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from minisarathi.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, window=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # ref 0 and not in the prefix cache
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, least recently used first
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block
        self.prefix_queries = 0  # tokens looked up at admission
        self.prefix_hits = 0  # of them, tokens served from the cache
        self.tables = np.zeros((16, 16), np.int32)  # int32[rows, width]: row seq.block_row = seq.block_table
        self._free_rows = list(range(16))
        # (source, destination) blocks to copy before the forward
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: truly free ones plus evictable cached ones."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # admission ----------------------------------------------------------------------------------------

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.cached_blocks.get(self._hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int, watermark: int) -> bool:
        """Whether seq can take `cached` and grow to `num_tokens` tokens leaving `watermark` blocks free."""
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)  # evictable blocks it takes off the pool
        new = self.blocks_for(num_tokens) - len(cached)
        return self.num_free_blocks - revived - new >= watermark

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give seq the cached blocks of its prefix; it starts computing after them."""
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        seq.block_table = list(cached)
        seq.block_row = self._take_row()
        self._widen(len(cached))
        self.tables[seq.block_row, : len(cached)] = cached
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_computed_tokens

    # growth ---------------------------------------------------------------------------------------------

    def shared_tail(self, seq: Sequence) -> bool:
        """Whether seq's next token goes into a partly filled block another sequence also holds."""
        block, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset != 0 and block < len(seq.block_table) and self.ref_counts[seq.block_table[block]] > 1

    def max_growth(self, seq: Sequence) -> int:
        """Tokens seq's blocks plus every free block can still hold (a shared tail is copied first)."""
        own = len(seq.block_table) - self.shared_tail(seq)
        return (own + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq's block table to cover its first `num_tokens` tokens, copying a shared tail first."""
        table, needed = seq.block_table, self.blocks_for(num_tokens)
        if seq.fork_tail and num_tokens > seq.num_computed_tokens:
            seq.fork_tail = False
            if self.shared_tail(seq):
                i = seq.num_computed_tokens // self.block_size
                # a sequence that reserved its final length (orca) copies into its own last, unused block:
                # max_growth counted that block as room, and the free list may be empty
                if len(table) > i + 1:
                    destination = table.pop()
                    self.tables[seq.block_row, len(table)] = 0
                else:
                    destination = self._allocate()
                source, table[i] = table[i], destination
                self.ref_counts[source] -= 1
                self.tables[seq.block_row, i] = table[i]
                self.pending_copies.append((source, table[i]))
        self._widen(needed)
        while len(table) < needed:
            block = self._allocate()
            self.tables[seq.block_row, len(table)] = block
            table.append(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (a choice of the same request) shares the blocks of parent's computed tokens; whichever of
        them first writes into the shared partial block gets a copy of it (grow)."""
        shared = parent.block_table[: self.blocks_for(parent.num_computed_tokens)]
        for block in shared:
            self.ref_counts[block] += block >= 0
        child.block_table = list(shared)
        child.block_row = self._take_row()
        self.tables[child.block_row, : len(shared)] = shared
        parent.fork_tail = child.fork_tail = parent.num_computed_tokens % self.block_size != 0
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_registered_blocks = parent.num_registered_blocks
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The step's (source, destination) pairs, to be copied now: their sources' references are dropped."""
        copies, self.pending_copies = self.pending_copies, []
        for source, _ in copies:
            if self.ref_counts[source] == 0:  # its last holder left in the same pass (_release kept it)
                self._list_idle(source)
        return copies

    def _allocate(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached_blocks[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("out of KV blocks: the scheduler must check before it grows a sequence")
        self.ref_counts[block] = 1
        return block

    def register_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Offer seq's newly full blocks among its first `num_tokens` (computed) tokens to the prefix cache,
        then free those before a sliding window. The engine passes what the step being updated computed: with
        overlap, seq.num_computed_tokens already counts the next step's chunk, whose last token may not be on
        the host yet, and seq may have been freed (preempted) since: it then holds no block to offer."""
        if seq.block_row < 0:
            return
        num_full = num_tokens // self.block_size if self.enable_prefix_caching else 0
        for i in range(seq.num_registered_blocks, num_full):
            block, h = seq.block_table[i], self._hash(seq, i)
            # a twin computed concurrently by another sequence keeps the entry; this block stays private
            if h not in self.cached_blocks:
                self.cached_blocks[h] = block
                self.block_hash[block] = h
        seq.num_registered_blocks = num_full
        # the next query (position num_tokens) sees no key before num_tokens - window + 1, nor do later ones
        dead = 0 if self.window is None else (num_tokens - self.window + 1) // self.block_size
        while dead > 0 and seq.block_table[dead - 1] >= 0:  # those before a freed block went before it
            dead -= 1
            self._release(seq.block_table[dead])
            seq.block_table[dead] = self.tables[seq.block_row, dead] = -1

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens tokens (rejected draft tokens' slots)."""
        while len(seq.block_table) > self.blocks_for(num_tokens):
            self._release(seq.block_table.pop())
            self.tables[seq.block_row, len(seq.block_table)] = 0

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; its tail goes back first so prefixes (more shared) are evicted last."""
        for block in reversed([block for block in seq.block_table if block >= 0]):  # -1: freed (window)
            self._release(block)
        if seq.block_row >= 0:
            self.tables[seq.block_row] = 0
            self._free_rows.append(seq.block_row)
        seq.block_table = []
        seq.block_row = -1
        seq.fork_tail = False
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        # a pending copy's source stays off the lists until the copy has run: else a sibling preempted later
        # in this pass could hand it out as another copy's destination, and a step's copies run in parallel
        if self.ref_counts[block] == 0 and all(block != source for source, _ in self.pending_copies):
            self._list_idle(block)

    def _list_idle(self, block: int) -> None:
        if self.block_hash[block] is None:
            self.free_blocks.append(block)
        else:
            self.evictable[block] = None

    def _take_row(self) -> int:
        if not self._free_rows:  # more sequences than ever before: twice the rows
            rows = len(self.tables)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self._free_rows = list(range(rows, 2 * rows))
        return self._free_rows.pop()

    def _widen(self, num_blocks: int) -> None:
        """Make `tables` rows hold `num_blocks` blocks (when longer than ever: the next power of 2)."""
        width = self.tables.shape[1]
        if num_blocks > width:
            wider = np.zeros((len(self.tables), 1 << (num_blocks - 1).bit_length()), np.int32)
            wider[:, :width] = self.tables
            self.tables = wider

    def _hash(self, seq: Sequence, i: int) -> bytes:
        """Chained hash of seq's full block i, computed once per block (tokens never change):
        SHA-256 of the parent block's hash (none for the first block) and the block's int32 token ids."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) <= i:
            n = len(hashes)
            tokens = np.array(seq.token_slice(n * size, (n + 1) * size), np.int32)
            hashes.append(hashlib.sha256((hashes[-1] if hashes else b"") + tokens.tobytes()).digest())
        return hashes[i]

    # checks ---------------------------------------------------------------------------------------------

    def check_invariants(self, live: list[Sequence]) -> None:
        """Ref counts equal the references held by the live sequences; every block is in exactly one place."""
        expected = [0] * self.num_blocks
        rows = np.zeros_like(self.tables)
        for seq in live:
            held = [block for block in seq.block_table if block >= 0]  # -1: freed before the window
            assert len(held) == len(set(held)), f"{seq.request_id} repeats a block"
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, seq.request_id
            assert seq.block_row >= 0, f"{seq.request_id} runs without a row of tables"
            rows[seq.block_row, : len(seq.block_table)] = seq.block_table
            for block in held:
                expected[block] += 1
        assert expected == self.ref_counts, "ref counts disagree with the block tables"
        assert (rows == self.tables).all(), "the tables matrix disagrees with the block tables"
        assert len({seq.block_row for seq in live}) == len(live) == len(self.tables) - len(self._free_rows)
        free, evictable = set(self.free_blocks), set(self.evictable)
        assert len(free) == len(self.free_blocks) and not free & evictable, "a block is listed twice"
        pending = {source for source, _ in self.pending_copies}
        for block in range(self.num_blocks):
            idle = self.ref_counts[block] == 0 and block not in pending
            assert idle == (block in free or block in evictable), f"block {block} lost or double-booked"
            if block in free or block in evictable:
                assert (block in evictable) == (self.block_hash[block] is not None), f"block {block} misfiled"
        assert {b: h for h, b in self.cached_blocks.items()} == {
            b: h for b, h in enumerate(self.block_hash) if h is not None
        }, "hash index out of sync"
