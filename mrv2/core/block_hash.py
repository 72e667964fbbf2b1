"""Content hashes of full KV blocks, chained so that a block's hash names its whole prefix.

Block `i` of a sequence hashes `(hash of block i - 1, token ids of block i)`; block 0 chains
from `ROOT_HASH`. Two sequences therefore share the hash of block `i` only if they share every
token up to the end of block `i`, which is exactly when block `i`'s KV is interchangeable.

The hash is SHA-256 over a fixed little-endian encoding (parent digest, then each token id as
an int64), truncated to 16 bytes. It does not depend on the process (no `hash()`, no pickle,
no PYTHONHASHSEED), so a hash computed in one process means the same in another. 128 bits make
an accidental collision practically impossible; the block pool still compares the stored token
ids (and parent hash) on every hit, so a collision can cost a hit but never a wrong one at the
block being looked up.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes
HASH_BYTES = 16

# The parent of block 0. A constant, not random: hashes must agree across processes.
ROOT_HASH: BlockHash = hashlib.sha256(b"mrv2 prefix cache v1").digest()[:HASH_BYTES]


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block."""
    data = parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(data).digest()[:HASH_BYTES]


def hash_block_chain(token_ids: Sequence[int], block_size: int,
                     parent_hash: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a trailing partial block is not hashed)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes
