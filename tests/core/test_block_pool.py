"""The block pool (core/block_pool.py): the null block, reference counts, the free queue's
order, and the prefix-cache statistics."""

import pytest

from mrv2.core.block_pool import BlockPool, PrefixCacheStats
from mrv2.protocol import NULL_BLOCK_ID


def test_block_pool_never_hands_out_null_block() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7 and pool.usage == 0.0
    blocks = pool.get_new_blocks(7)
    assert sorted(blocks) == list(range(1, 8))
    assert NULL_BLOCK_ID not in blocks
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks[:3])
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(4 / 7)


def test_block_pool_ref_counts_and_double_free() -> None:
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert pool.ref_count(b) == 1
    pool.free_blocks([b])
    assert pool.ref_count(b) == 0 and pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([NULL_BLOCK_ID])
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError):
        BlockPool(1)


def test_block_pool_fifo_reuse() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.free_blocks(a)
    # The block never used (3) comes first, then the freed ones in the order they were freed.
    assert pool.get_new_blocks(3) == [3] + a


def test_prefix_cache_stats() -> None:
    stats = PrefixCacheStats()
    assert stats.hit_rate == 0.0
    stats.record(10, 8)
    stats.record(6, 0)
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 8)
    assert stats.hit_rate == 0.5
    stats.reset()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
