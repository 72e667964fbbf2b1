"""KV-cache block accounting for the scheduler: a block pool and per-request block lists.

Only ids are managed here; the KV tensors live on the worker. Block `b` holds the K/V of token
positions [i * block_size, (i + 1) * block_size) of the request whose block list has `b` at
index `i`.

Invariants:
- Block 0 is the null block. It is never handed out, so a padded block-table row (all zeros)
  can never alias a live request's KV.
- A block is either in the free list (ref count 0) or referenced (ref count >= 1), never both.
  Ref counts, rather than a plain owner flag, leave room for prefix caching, where several
  requests reference one full block.
- A request's block list covers exactly cdiv(tokens allocated for, block_size) blocks; it only
  grows until the request is freed (recompute-mode preemption frees it whole).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from mrv2.engine.request import Request

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """`num_blocks` ids, 0 reserved as the null block; the other ids are allocatable."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the null block plus at least one")
        self.num_blocks = num_blocks
        # FIFO free list: freed blocks go to the back, so the least recently freed block is
        # reused first (the order prefix caching will want for eviction).
        self._free: deque[int] = deque(range(1, num_blocks))
        self._ref_cnt: list[int] = [0] * num_blocks
        self._ref_cnt[NULL_BLOCK_ID] = 1  # pinned forever: it can never enter the free list

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the allocatable blocks (the null block excluded) in use, in [0, 1]."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take `n` free blocks (ref count 1 each). Raises ValueError if fewer are free."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} blocks: only {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_cnt[b] = 1
        return blocks

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block with no references left becomes free.

        Blocks are appended to the free list in the order given, so callers pass a request's
        blocks tail first (the tail is the least likely to be shared once prefixes are cached).
        """
        for b in block_ids:
            if b == NULL_BLOCK_ID or self._ref_cnt[b] <= 0:
                # A double free would put one id in the free list twice and later hand the same
                # KV memory to two requests: fail loudly instead.
                raise RuntimeError(f"block {b} freed but not allocated")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]


class KVCacheManager:
    """Per-request block lists on top of a `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks)
        self._req_to_blocks: dict[str, list[int]] = {}

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
        """Blocks already holding a prefix of `request`, and how many tokens they cover.

        Prefix caching is not implemented yet, so nothing is ever cached: ([], 0). This is
        the hook the scheduler will call before allocating for a waiting request.
        """
        return [], 0

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after `request.num_computed_tokens`.

        Returns the newly allocated block ids (the delta, possibly []), or None, allocating
        nothing, when the pool cannot cover num_computed_tokens + num_new_tokens.
        """
        total = request.num_computed_tokens + num_new_tokens
        if num_new_tokens < 0 or total > self.max_model_len:
            raise ValueError(f"{request.request_id!r}: cannot allocate {num_new_tokens} tokens "
                             f"after {request.num_computed_tokens} (max_model_len="
                             f"{self.max_model_len})")
        blocks = self._req_to_blocks.get(request.request_id)
        num_have = 0 if blocks is None else len(blocks)
        num_needed = self.num_blocks_for(total) - num_have
        if num_needed <= 0:
            if blocks is None:
                self._req_to_blocks[request.request_id] = []
            return []
        if num_needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        if blocks is None:
            self._req_to_blocks[request.request_id] = list(new_blocks)
        else:
            blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool. Idempotent: a second call is a no-op."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block list ([] for a request holding no blocks)."""
        return list(self._req_to_blocks.get(req_id, ()))
