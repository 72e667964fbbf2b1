import pytest

from mrv2.engine.kv_cache_manager import NULL_BLOCK_ID, BlockPool, KVCacheManager
from mrv2.engine.request import Request
from mrv2.sampling_params import SamplingParams


def make_request(req_id: str, prompt_len: int) -> Request:
    return Request(req_id, list(range(prompt_len)), SamplingParams(max_tokens=8))


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


def test_allocate_slots_returns_delta() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    req = make_request("r", 6)
    assert mgr.get_computed_blocks(req) == ([], 0)
    first = mgr.allocate_slots(req, 6)
    assert first is not None and len(first) == 2
    req.num_computed_tokens = 6
    assert mgr.allocate_slots(req, 2) == []  # positions 6, 7 still fit in block 2
    req.num_computed_tokens = 8
    third = mgr.allocate_slots(req, 1)
    assert third is not None and len(third) == 1
    assert mgr.get_block_ids("r") == first + third
    assert mgr.num_free_blocks == 6
    assert mgr.get_block_ids("unknown") == []


def test_allocate_slots_all_or_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4, max_model_len=64)  # 3 usable blocks
    a, b = make_request("a", 8), make_request("b", 8)
    assert mgr.allocate_slots(a, 8) is not None
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.num_free_blocks == 1 and mgr.get_block_ids("b") == []
    assert mgr.allocate_slots(b, 4) is not None
    assert mgr.num_free_blocks == 0


def test_allocate_beyond_max_model_len_raises() -> None:
    mgr = KVCacheManager(num_blocks=100, block_size=4, max_model_len=16)
    with pytest.raises(ValueError):
        mgr.allocate_slots(make_request("r", 4), 17)


def test_free_is_idempotent() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=2, max_model_len=64)
    req = make_request("r", 7)
    assert mgr.allocate_slots(req, 7) is not None
    assert mgr.usage == 1.0
    mgr.free(req)
    mgr.free(req)  # a second free must not double-free
    assert mgr.num_free_blocks == 4 and mgr.usage == 0.0
    assert mgr.get_block_ids("r") == []
    mgr.free(make_request("never-allocated", 3))
    assert mgr.num_free_blocks == 4
