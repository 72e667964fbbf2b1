"""KV-cache block accounting for the scheduler: per-request block lists on a block pool
(block_pool.py), with prefix caching and sliding-window groups (kv_cache_layout.py).

Only ids are managed here; the KV tensors live on the worker. Block `b` holds the K/V of token
positions [i * block_size, (i + 1) * block_size) of every request whose block list has `b` at
index `i`.

Prefix caching (vLLM v1 semantics, `enable_caching=True`):
- Once a block is full of tokens whose ids are known, it is registered under the chained hash
  of its contents (block_hash.py). A later request whose prompt starts with the same tokens
  reuses the block instead of recomputing it ("hit").
- A block is shared through reference counts. When the last reference goes, a registered block
  stays registered: it sits in the free queue, counts as free, and keeps its KV until the pool
  needs the memory. Then it is evicted least-recently-freed first. A hit on a block that sits
  in the free queue takes it out again ("touch").
- A request's blocks are freed tail first, so when the pool reclaims them it takes a request's
  last blocks (the least likely to be shared) before its first.

Invariants:
- Block 0 is the null block. It is never handed out, so a padded block-table row (all zeros)
  can never alias a live request's KV.
- A block is in the free queue iff its ref count is 0. A freed block is never freed again
  (a second free raises instead of handing one block to two requests).
- A hash maps to at most one block, and a registered block holds the hash, parent hash and
  token ids it was registered with; a hit compares all three (collision check).
- Only full blocks whose token ids are known are registered, when the step that computes them
  is scheduled (as vLLM does). A request scheduled later in the same step may already hit
  them: within a forward pass every layer writes the whole batch's K/V before attending.
  After that step a registered block is never written again: requests write only past their
  computed prefix, and a hit ends before a request's first computed token.
- A request holds one block list per KV cache group. Each covers exactly cdiv(tokens allocated
  for, block_size) logical blocks, the same count in every group; it only grows until the
  request is freed (recompute-mode preemption frees it whole).
- In a windowed group, the blocks wholly behind the window of the request's next query are
  given back (the entry becomes the null block) before each allocation: no later query of the
  request reads them. The worker's table keeps the stale id, which no result depends on
  (the kernels start a windowed row's keys at its window, or mask what lies before it). A
  prefix hit in a windowed group needs only the blocks of the window behind the hit; the ones
  before it are null.
- A block is registered in one group: the cache's key is the chained hash salted with the
  group, so two groups' copies of one prefix never hit each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mrv2.core import block_hash
from mrv2.core.block_hash import ROOT_HASH, BlockHash
from mrv2.core.block_pool import BlockPool, PrefixCacheStats
from mrv2.core.kv_cache_layout import KVCacheLayout
from mrv2.core.request import Request
from mrv2.protocol import NULL_BLOCK_ID

HashFn = Callable[[BlockHash, Sequence[int]], BlockHash]
# Per KV cache group, a list of block ids (one request's, or one step's delta of it).
GroupBlockIds = tuple[list[int], ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group_key(block_hash: BlockHash, group: int) -> BlockHash:
    return block_hash if group == 0 else block_hash + group.to_bytes(1, "little")


class KVCacheManager:
    """Per-request block lists on top of a `BlockPool`, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = False, hash_fn: HashFn | None = None,
                 layout: KVCacheLayout | None = None, max_new_tokens: int | None = None
                 ) -> None:
        """`layout`: the model's KV cache groups (one full-attention group when None);
        `max_new_tokens`: the most tokens one step allocates for a request (bounds what a
        windowed group holds; max_model_len when None)."""
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.layout = layout or KVCacheLayout.for_windows(None, 1)
        self.max_new_tokens = max_new_tokens or max_model_len
        self.num_groups = self.layout.num_groups
        # (group, window) of the windowed groups: the only ones that ever drop blocks.
        self._window_groups = tuple((g, group) for g, group in enumerate(self.layout.groups)
                                    if group.window)
        self._no_new_blocks: GroupBlockIds = tuple([] for _ in range(self.num_groups))
        # Looked up at construction, so tests can monkeypatch block_hash.hash_block_tokens.
        self._hash_fn: HashFn = hash_fn or block_hash.hash_block_tokens
        self.block_pool = BlockPool(num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_to_blocks: dict[str, GroupBlockIds] = {}
        # Per request and windowed group: how many leading entries are null (given back).
        self._num_dropped: dict[str, list[int]] = {}
        # Per request: chained hashes of its full blocks computed so far (lazily extended;
        # token ids never change once known), and how many leading blocks are registered.
        self._req_to_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks one request could ever hold: the whole pool but the null block."""
        return self.block_pool.num_blocks - 1

    def num_blocks_for(self, num_tokens: int) -> int:
        """Block ids a request of `num_tokens` tokens holds at most, over all groups."""
        return self.layout.max_blocks_per_request(num_tokens, self.block_size,
                                                  self.max_new_tokens)

    def num_blocks_held(self, req_id: str) -> int:
        """Block ids the request holds now (null entries of windowed groups excluded)."""
        return sum(len(blocks) - blocks.count(NULL_BLOCK_ID)
                   for blocks in self._req_to_blocks.get(req_id, ()))

    # -- prefix cache lookup ----------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlockIds, int]:
        """The longest cached prefix of `request` in full blocks (per group, the blocks its
        layers read: all of them, or a windowed group's window behind the hit with null
        before it), and the tokens it covers.

        The hit never covers the last token (vLLM's max cache hit length is num_tokens - 1):
        that token must be computed so there are logits to sample from. Nothing is taken or
        recorded here; `allocate_slots(..., new_computed_blocks=...)` takes the blocks. A
        request that needs every prompt position's logits (prompt logprobs) gets no hit.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self._no_new_blocks, 0
        bs, pool, tokens = self.block_size, self.block_pool, request.all_token_ids
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        hash_fn = self._hash_fn
        parents = [ROOT_HASH]
        keys: list[tuple[int, ...]] = []  # the token ids of each block walked
        looked_up: dict[tuple[int, int], int | None] = {}

        def cached(group: int, i: int) -> int | None:
            if (group, i) not in looked_up:
                looked_up[group, i] = pool.get_cached_block(
                    _group_key(hashes[i], group), parents[i], keys[i])
            return looked_up[group, i]

        groups = self.layout.groups
        full = [g for g, group in enumerate(groups) if not group.window]
        num_hit = 0  # the full groups' common prefix (all blocks when there is none)
        for i in range(max_blocks):
            keys.append(tuple(tokens[i * bs:(i + 1) * bs]))
            if i == len(hashes):  # hashed lazily
                hashes.append(hash_fn(parents[i], keys[i]))
            parents.append(hashes[i])
            if any(cached(g, i) is None for g in full):
                break  # a miss in a full group ends every group's hit
            num_hit = i + 1
        # A windowed group needs the blocks of the window behind the hit: shorten the hit
        # until every windowed group has them.
        while num_hit and not all(
                cached(g, i) is not None for g, group in self._window_groups
                for i in range(group.first_live_block(num_hit * bs, bs), num_hit)):
            num_hit -= 1
        hit_blocks = tuple(
            [NULL_BLOCK_ID if i < group.first_live_block(num_hit * bs, bs) else cached(g, i)
             for i in range(num_hit)] for g, group in enumerate(groups))
        return hit_blocks, num_hit * bs

    # -- allocation ---------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlockIds | None = None
                       ) -> GroupBlockIds | None:
        """Make room for `num_new_tokens` tokens after the request's computed prefix.

        `new_computed_blocks` (from `get_computed_blocks`, for a request that holds no blocks
        yet) become the head of its block lists; they extend `request.num_computed_tokens` by
        their length * block_size. Returns the newly allocated block ids per group (the delta,
        possibly empty, hits excluded), or None when the pool cannot cover the hits taken out
        of the free queue plus the new blocks; then nothing changes but the windowed groups'
        blocks behind the window, which are given back first in any case.

        With caching on, full blocks up to the end of the new tokens (known tokens only) are
        registered, so later requests can hit them.
        """
        req_id = request.request_id
        bs = self.block_size
        hits = new_computed_blocks if new_computed_blocks and new_computed_blocks[0] else None
        blocks = self._req_to_blocks.get(req_id)
        if hits is None and blocks is not None:
            if self._window_groups:
                self._drop_behind_window(req_id, blocks, request.num_computed_tokens)
            # Fast path (a decode step, 15 of 16 steps): the tokens fit in the blocks the
            # request holds and no block fills up within its known tokens, so there is
            # nothing to allocate or register.
            total = request.num_computed_tokens + num_new_tokens
            if (0 <= num_new_tokens and total <= self.max_model_len
                    and total <= len(blocks[0]) * bs
                    and (not self.enable_caching or min(total, request.num_tokens)
                         // bs <= self._num_cached_blocks.get(req_id, 0))):
                return self._no_new_blocks
        num_hits = len(hits[0]) if hits else 0
        num_computed = request.num_computed_tokens + num_hits * bs
        total = num_computed + num_new_tokens
        if num_new_tokens < 0 or total > self.max_model_len:
            raise ValueError(f"{req_id!r}: cannot allocate {num_new_tokens} tokens "
                             f"after {num_computed} (max_model_len={self.max_model_len})")
        if hits and blocks and blocks[0]:
            raise ValueError(f"{req_id!r}: prefix hits for a request that already holds blocks")
        num_have = num_hits + (len(blocks[0]) if blocks else 0)
        num_needed = max(cdiv(total, bs) - num_have, 0)
        pool = self.block_pool
        # Hits sitting in the free queue leave it, so they count against the free blocks.
        num_evictable_hits = 0 if not hits else sum(
            1 for group_hits in hits for b in group_hits
            if b != NULL_BLOCK_ID and pool.ref_count(b) == 0)
        if num_needed * self.num_groups + num_evictable_hits > pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self._req_to_blocks[req_id] = tuple([] for _ in range(self.num_groups))
            self._num_dropped[req_id] = [0] * self.num_groups
        if hits:
            for g, group_hits in enumerate(hits):
                pool.touch(b for b in group_hits if b != NULL_BLOCK_ID)
                blocks[g].extend(group_hits)
                self._num_dropped[req_id][g] = group_hits.count(NULL_BLOCK_ID)
            self._num_cached_blocks[req_id] = num_hits
        if not num_needed:
            new_blocks = self._no_new_blocks
        else:
            new_blocks = tuple(pool.get_new_blocks(num_needed) for _ in range(self.num_groups))
            for group_blocks, group_new in zip(blocks, new_blocks):
                group_blocks.extend(group_new)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return new_blocks

    def _drop_behind_window(self, req_id: str, blocks: GroupBlockIds,
                            num_computed_tokens: int) -> None:
        """Give back each windowed group's blocks that no query from `num_computed_tokens` on
        reads; their entries become the null block."""
        dropped = self._num_dropped[req_id]
        for g, group in self._window_groups:
            first_live = min(group.first_live_block(num_computed_tokens, self.block_size),
                             len(blocks[g]))
            if first_live <= dropped[g]:
                continue
            group_blocks = blocks[g]
            freed = [b for b in group_blocks[dropped[g]:first_live] if b != NULL_BLOCK_ID]
            group_blocks[dropped[g]:first_live] = [NULL_BLOCK_ID] * (first_live - dropped[g])
            dropped[g] = first_live
            if freed:
                self.block_pool.free_blocks(reversed(freed))

    def _cache_full_blocks(self, request: Request, blocks: GroupBlockIds,
                           num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens
        (each group's under its own key; a windowed group's null entries are skipped)."""
        req_id = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_cached_blocks.get(req_id, 0)
        if num_full <= start:
            return
        # Hashes exist for at least the registered blocks (a lookup hashes past its hits).
        hashes = self._req_to_hashes.setdefault(req_id, [])
        tokens, bs, pool = request.all_token_ids, self.block_size, self.block_pool
        hash_fn = self._hash_fn
        parent = hashes[start - 1] if start else ROOT_HASH
        for i in range(start, num_full):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            if i == len(hashes):
                hashes.append(hash_fn(parent, block_tokens))
            for g, group_blocks in enumerate(blocks):
                if group_blocks[i] != NULL_BLOCK_ID:
                    pool.cache_block(group_blocks[i], _group_key(hashes[i], g), parent,
                                     block_tokens)
            parent = hashes[i]
        self._num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first. Idempotent: a second call is
        a no-op. Registered blocks stay cached (and evictable)."""
        req_id = request.request_id
        blocks = self._req_to_blocks.pop(req_id, None)
        self._num_dropped.pop(req_id, None)
        self._req_to_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        if blocks:
            for group_blocks in blocks:
                self.block_pool.free_blocks(b for b in reversed(group_blocks)
                                            if b != NULL_BLOCK_ID)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, req_id: str) -> GroupBlockIds:
        """A copy of the request's block lists, one per group (empty lists for a request
        holding no blocks)."""
        blocks = self._req_to_blocks.get(req_id)
        if blocks is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(list(group_blocks) for group_blocks in blocks)
