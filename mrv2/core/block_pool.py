"""The block pool: KV block ids, their reference counts, the free queue and the prefix cache's
hash -> block map (kv_cache_manager.py keeps the per-request lists on top of it).

Block 0 is the null block: never handed out, so a padded block-table row (all zeros) can never
alias a live request's KV. A block is in the free queue iff its ref count is 0; a freed block
is never freed again. A registered block stays registered while it sits in the free queue and
is evicted, least recently freed first, only when the pool hands it out again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from mrv2.core.block_hash import BlockHash
from mrv2.protocol import NULL_BLOCK_ID


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last reset: one per admitted request (or resumption)."""

    requests: int = 0
    queries: int = 0  # tokens of the admitted requests (prompt, plus outputs when resumed)
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_queried: int, num_hit: int) -> None:
        self.requests += 1
        self.queries += num_queried
        self.hits += num_hit

    def reset(self) -> None:
        self.requests = self.queries = self.hits = 0


class BlockPool:
    """`num_blocks` ids, 0 reserved as the null block; the other ids are allocatable."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        self.num_blocks = num_blocks
        # Free queue, oldest first: the head is handed out (and, if registered, evicted) first.
        # An OrderedDict gives O(1) popleft, append and removal from the middle (touch).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._ref_cnt: list[int] = [0] * num_blocks
        self._ref_cnt[NULL_BLOCK_ID] = 1  # pinned forever: it can never enter the free queue
        # Registered blocks: hash -> block, and per block what it was registered with.
        self._cached: dict[BlockHash, int] = {}
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_key: list[tuple[BlockHash, tuple[int, ...]] | None] = [None] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, registered (evictable) ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks (the null block excluded) held by requests."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to go) first. For tests and debugging."""
        return list(self._free)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take `n` blocks from the head of the free queue (ref count 1 each), evicting any
        that are registered. Raises ValueError if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} blocks: only {len(self._free)} free")
        free, ref_cnt, block_hash = self._free, self._ref_cnt, self._block_hash
        blocks = []
        for _ in range(n):
            b = free.popitem(last=False)[0]
            if block_hash[b] is not None:
                self._evict(b)
            ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each (registered) block, taking free ones out of the queue."""
        free, ref_cnt = self._free, self._ref_cnt
        for b in block_ids:
            if ref_cnt[b] == 0:
                del free[b]
            ref_cnt[b] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block with no references left becomes free.

        Blocks are appended to the free queue in the order given, so callers pass a request's
        blocks tail first: the tail is then evicted before the head.
        """
        free, ref_cnt = self._free, self._ref_cnt
        for b in block_ids:
            if b == NULL_BLOCK_ID or ref_cnt[b] <= 0:
                # A double free would queue one id twice and later hand the same KV memory to
                # two requests: fail loudly instead.
                raise RuntimeError(f"block {b} freed but not allocated")
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                free[b] = None

    # -- prefix cache ----------------------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash,
                    token_ids: tuple[int, ...]) -> bool:
        """Register a full, held block. False (nothing changes) when the hash is taken: the
        same contents were computed twice, or a collision; the first registration stays."""
        if block_hash in self._cached or self._block_hash[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        self._block_key[block_id] = (parent_hash, token_ids)
        return True

    def get_cached_block(self, block_hash: BlockHash, parent_hash: BlockHash,
                         token_ids: tuple[int, ...]) -> int | None:
        """The block registered under `block_hash` if it holds exactly these contents."""
        b = self._cached.get(block_hash)
        if b is None or self._block_key[b] != (parent_hash, token_ids):
            return None  # a miss, or a hash collision caught by the token / parent check
        return b

    def _evict(self, block_id: int) -> None:
        del self._cached[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        self._block_key[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block. Only when no block is held (else False)."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for b in self._cached.values():
            self._block_hash[b] = None
            self._block_key[b] = None
        self._cached.clear()
        return True
