"""KV-cache block accounting for the scheduler: a block pool with prefix caching.

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
- A request's block list covers exactly cdiv(tokens allocated for, block_size) blocks; it only
  grows until the request is freed (recompute-mode preemption frees it whole).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mrv2.core import block_hash
from mrv2.core.block_hash import ROOT_HASH, BlockHash
from mrv2.core.request import Request
from mrv2.protocol import NULL_BLOCK_ID

HashFn = Callable[[BlockHash, Sequence[int]], BlockHash]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


class KVCacheManager:
    """Per-request block lists on top of a `BlockPool`, with optional prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = False, hash_fn: HashFn | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # Looked up at construction, so tests can monkeypatch block_hash.hash_block_tokens.
        self._hash_fn: HashFn = hash_fn or block_hash.hash_block_tokens
        self.block_pool = BlockPool(num_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_to_blocks: dict[str, list[int]] = {}
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
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of `request` in full blocks, and the tokens it covers.

        The hit never covers the last token (vLLM's max cache hit length is num_tokens - 1):
        that token must be computed so there are logits to sample from. Nothing is taken or
        recorded here; `allocate_slots(..., new_computed_blocks=...)` takes the blocks. A
        request that needs every prompt position's logits (prompt logprobs) gets no hit.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        bs, pool, tokens = self.block_size, self.block_pool, request.all_token_ids
        max_blocks = (request.num_tokens - 1) // bs
        hashes = self._req_to_hashes.setdefault(request.request_id, [])
        hash_fn = self._hash_fn
        parent = ROOT_HASH
        blocks: list[int] = []
        for i in range(max_blocks):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            if i == len(hashes):  # hashed lazily: a miss stops the walk early
                hashes.append(hash_fn(parent, block_tokens))
            b = pool.get_cached_block(hashes[i], parent, block_tokens)
            if b is None:
                break
            blocks.append(b)
            parent = hashes[i]
        return blocks, len(blocks) * bs

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the request's computed prefix.

        `new_computed_blocks` (from `get_computed_blocks`, for a request that holds no blocks
        yet) become the head of its block list; they extend `request.num_computed_tokens` by
        `len(new_computed_blocks) * block_size`. Returns the newly allocated block ids (the
        delta, possibly [], hits excluded), or None, changing nothing, when the pool cannot
        cover the hits taken out of the free queue plus the new blocks.

        With caching on, full blocks up to the end of the new tokens (known tokens only) are
        registered, so later requests can hit them.
        """
        req_id = request.request_id
        if not new_computed_blocks:
            # Fast path (a decode step, 15 of 16 steps): the tokens fit in the blocks the
            # request holds and no block fills up within its known tokens, so there is
            # nothing to allocate or register.
            blocks = self._req_to_blocks.get(req_id)
            total = request.num_computed_tokens + num_new_tokens
            if (blocks is not None and 0 <= num_new_tokens and total <= self.max_model_len
                    and total <= len(blocks) * self.block_size
                    and (not self.enable_caching or min(total, request.num_tokens)
                         // self.block_size <= self._num_cached_blocks.get(req_id, 0))):
                return []
        hits = new_computed_blocks or ()
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        if num_new_tokens < 0 or total > self.max_model_len:
            raise ValueError(f"{request.request_id!r}: cannot allocate {num_new_tokens} tokens "
                             f"after {num_computed} (max_model_len={self.max_model_len})")
        blocks = self._req_to_blocks.get(req_id)
        if hits and blocks:
            raise ValueError(f"{req_id!r}: prefix hits for a request that already holds blocks")
        num_have = len(hits) + (0 if blocks is None else len(blocks))
        num_needed = max(self.num_blocks_for(total) - num_have, 0)
        pool = self.block_pool
        # Hits sitting in the free queue leave it, so they count against the free blocks.
        num_evictable_hits = sum(1 for b in hits if pool.ref_count(b) == 0)
        if num_needed + num_evictable_hits > pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self._req_to_blocks[req_id] = []
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            self._num_cached_blocks[req_id] = len(hits)
        new_blocks = pool.get_new_blocks(num_needed) if num_needed else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens."""
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
            pool.cache_block(blocks[i], hashes[i], parent, block_tokens)
            parent = hashes[i]
        self._num_cached_blocks[req_id] = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first. Idempotent: a second call is
        a no-op. Registered blocks stay cached (and evictable)."""
        req_id = request.request_id
        blocks = self._req_to_blocks.pop(req_id, None)
        self._req_to_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block list ([] for a request holding no blocks)."""
        return list(self._req_to_blocks.get(req_id, ()))
