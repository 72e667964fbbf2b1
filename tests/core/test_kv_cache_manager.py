import hashlib
import struct

import pytest

from mrv2.core import block_hash
from mrv2.core.kv_cache_manager import KVCacheManager
from mrv2.core.request import Request
from mrv2.sampling_params import SamplingParams


def make_request(req_id: str, prompt_len: int) -> Request:
    return Request(req_id, list(range(prompt_len)), SamplingParams(max_tokens=8))


def test_allocate_slots_returns_delta() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    req = make_request("r", 6)
    assert mgr.get_computed_blocks(req) == (([],), 0)
    first = mgr.allocate_slots(req, 6)
    assert first is not None and len(first) == 1 and len(first[0]) == 2
    req.num_computed_tokens = 6
    assert mgr.allocate_slots(req, 2) == ([],)  # positions 6, 7 still fit in block 2
    req.num_computed_tokens = 8
    third = mgr.allocate_slots(req, 1)
    assert third is not None and len(third) == 1 and len(third[0]) == 1
    assert mgr.get_block_ids("r") == (first[0] + third[0],)
    assert mgr.num_blocks_held("r") == 3
    assert mgr.num_free_blocks == 6
    assert mgr.get_block_ids("unknown") == ([],)


def test_allocate_slots_all_or_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4, max_model_len=64)  # 3 usable blocks
    a, b = make_request("a", 8), make_request("b", 8)
    assert mgr.allocate_slots(a, 8) is not None
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.num_free_blocks == 1 and mgr.get_block_ids("b") == ([],)
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
    assert mgr.get_block_ids("r") == ([],)
    mgr.free(make_request("never-allocated", 3))
    assert mgr.num_free_blocks == 4


# -- prefix caching ---------------------------------------------------------------------------

def tokens_request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8))


def caching_manager(num_blocks: int = 16, block_size: int = 4, **kwargs) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, max_model_len=256, enable_caching=True,
                          **kwargs)


def run_prefill(mgr: KVCacheManager, req: Request) -> list[int]:
    """Admit `req` the way the scheduler does (hits, then the rest) and compute its prompt;
    returns its blocks (of the one KV cache group)."""
    hits, num_hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens
    (blocks,) = mgr.get_block_ids(req.request_id)
    return blocks


def test_block_hash_is_a_stable_chain() -> None:
    # Golden values: the hash must not depend on the process (PYTHONHASHSEED, pickle, ...).
    assert block_hash.ROOT_HASH.hex() == "db37bd618e52d60f4af37320480aec35"
    h0 = block_hash.hash_block_tokens(block_hash.ROOT_HASH, (1, 2, 3, 4))
    assert h0.hex() == "a5d83ce8a6508bbcfff1c3ca8dedf8a7"
    spec = hashlib.sha256(block_hash.ROOT_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()[:16]
    assert h0 == spec
    h1 = block_hash.hash_block_tokens(h0, (5, 6, 7, 8))
    assert block_hash.hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, h1]
    # The parent is part of the hash: the same tokens after a different prefix differ.
    assert block_hash.hash_block_tokens(block_hash.ROOT_HASH, (5, 6, 7, 8)) != h1
    assert block_hash.hash_block_chain([2, 1, 3, 4, 5, 6, 7, 8], 4)[1] != h1
    assert block_hash.hash_block_chain([1, 2, 3], 4) == []


@pytest.mark.parametrize("prompt_len, num_hit", [(9, 8), (10, 8), (8, 4), (4, 0), (1, 0)])
def test_same_prompt_hits_full_blocks_but_never_the_last_token(prompt_len, num_hit) -> None:
    mgr = caching_manager()
    prompt = list(range(100, 100 + prompt_len))
    a_blocks = run_prefill(mgr, tokens_request("a", prompt))
    assert mgr.block_pool.num_cached_blocks == prompt_len // 4
    b = tokens_request("b", prompt)
    hits, n = mgr.get_computed_blocks(b)
    assert n == num_hit and hits == (a_blocks[:num_hit // 4],)
    new = mgr.allocate_slots(b, prompt_len - n, hits)
    assert new is not None and mgr.get_block_ids("b") == (hits[0] + new[0],)
    assert all(mgr.block_pool.ref_count(x) == 2 for x in hits[0])
    assert mgr.get_computed_blocks(tokens_request("c", [7] + prompt[1:])) == (([],), 0)


def test_hit_stops_at_the_first_differing_block() -> None:
    mgr = caching_manager()
    prompt = list(range(100, 117))  # 4 full blocks + 1 token
    blocks = run_prefill(mgr, tokens_request("a", prompt))
    changed = prompt[:9] + [0] + prompt[10:]  # differs inside block 2
    assert mgr.get_computed_blocks(tokens_request("b", changed)) == ((blocks[:2],), 8)
    longer = prompt + list(range(50))
    assert mgr.get_computed_blocks(tokens_request("c", longer)) == ((blocks[:4],), 16)


def test_hash_collision_is_caught_by_the_token_check(monkeypatch) -> None:
    # Every block hashes alike: only the stored tokens (and parent) tell them apart.
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda parent, tokens: b"\0" * 16)
    mgr = caching_manager()
    a = tokens_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    a_blocks = run_prefill(mgr, a)
    # The second block's hash was taken (by the first): it stays unregistered.
    assert mgr.block_pool.num_cached_blocks == 1
    assert mgr.block_pool.block_hash(a_blocks[1]) is None
    # Same hash, different tokens: a miss, not a wrong hit.
    assert mgr.get_computed_blocks(tokens_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == (([],), 0)
    # The first block matches; the second's hash leads to block 0's entry, whose parent and
    # tokens differ: the hit stops after one block.
    assert mgr.get_computed_blocks(tokens_request("c", a.prompt_token_ids)) == ((a_blocks[:1],), 4)


def test_free_keeps_cached_blocks_and_evicts_lru_tail_first() -> None:
    mgr = caching_manager(num_blocks=8)  # 7 usable
    a = tokens_request("a", list(range(100, 113)))  # 3 full blocks + 1 token: 4 blocks
    b = tokens_request("b", list(range(200, 209)))  # 2 full blocks + 1 token: 3 blocks
    a_blocks, b_blocks = run_prefill(mgr, a), run_prefill(mgr, b)
    assert mgr.num_free_blocks == 0 and mgr.usage == 1.0
    mgr.free(a)
    mgr.free(b)
    # Freed blocks stay cached and count as free; each request's tail goes first.
    assert mgr.num_free_blocks == 7 and mgr.usage == 0.0
    assert mgr.block_pool.num_cached_blocks == 5
    assert mgr.block_pool.free_block_ids() == a_blocks[::-1] + b_blocks[::-1]
    a2, b2 = tokens_request("a2", a.prompt_token_ids), tokens_request("b2", b.prompt_token_ids)
    assert mgr.get_computed_blocks(a2)[1] == 12
    # A new request needing 2 blocks takes a's partial tail block and its last full block.
    assert mgr.allocate_slots(tokens_request("x", [0] * 8), 8) == (a_blocks[:1:-1],)
    assert mgr.get_computed_blocks(a2) == ((a_blocks[:2],), 8)  # block 2 was evicted
    assert mgr.get_computed_blocks(b2) == ((b_blocks[:2],), 8)  # b untouched
    assert mgr.block_pool.num_cached_blocks == 5 - 1 + 2  # one evicted, x's two registered


def test_hit_touches_blocks_out_of_the_free_queue() -> None:
    mgr = caching_manager(num_blocks=8)
    a = tokens_request("a", list(range(100, 109)))
    a_blocks = run_prefill(mgr, a)
    mgr.free(a)
    b = tokens_request("b", a.prompt_token_ids)
    group_hits, n = mgr.get_computed_blocks(b)
    (hits,) = group_hits
    assert n == 8 and mgr.num_free_blocks == 7  # a lookup alone takes nothing
    assert mgr.allocate_slots(b, 1, group_hits) is not None
    # The two hits left the queue; b's tail reused a's freed tail block (the queue head was
    # the never-used blocks, so a's partial block is still queued).
    assert set(hits).isdisjoint(mgr.block_pool.free_block_ids())
    assert mgr.num_free_blocks == 4
    mgr.free(b)
    # Freed again, the hits are now the most recently used: at the back of the queue.
    assert mgr.block_pool.free_block_ids()[-2:] == hits[::-1]
    assert a_blocks[:2] == hits


def test_shared_blocks_are_ref_counted_and_never_double_freed() -> None:
    mgr = caching_manager(num_blocks=10)
    prompt = list(range(100, 109))
    a, b = tokens_request("a", prompt), tokens_request("b", prompt)
    a_blocks, b_blocks = run_prefill(mgr, a), run_prefill(mgr, b)
    shared = a_blocks[:2]
    assert b_blocks[:2] == shared and b_blocks[2] != a_blocks[2]
    assert [mgr.block_pool.ref_count(x) for x in shared] == [2, 2]
    assert mgr.num_free_blocks == 9 - 4
    mgr.free(a)
    mgr.free(a)  # idempotent
    assert [mgr.block_pool.ref_count(x) for x in shared] == [1, 1]
    assert set(shared).isdisjoint(mgr.block_pool.free_block_ids())
    mgr.free(b)
    assert [mgr.block_pool.ref_count(x) for x in shared] == [0, 0]
    assert mgr.num_free_blocks == 9
    with pytest.raises(RuntimeError):
        mgr.block_pool.free_blocks(shared[:1])


def test_allocate_counts_evictable_hits_against_free_blocks() -> None:
    mgr = caching_manager(num_blocks=6)  # 5 usable
    a = tokens_request("a", list(range(100, 109)))
    a_blocks = run_prefill(mgr, a)  # 3 blocks, 2 of them full and cached
    mgr.free(a)
    hog = tokens_request("hog", [0] * 12)
    assert mgr.allocate_slots(hog, 12) is not None  # 2 never-used blocks + a's tail block
    assert mgr.block_pool.free_block_ids() == a_blocks[1::-1]  # only a's cached blocks left
    b = tokens_request("b", a.prompt_token_ids + [1, 2, 3, 4])  # 13 tokens
    hits, n = mgr.get_computed_blocks(b)
    assert hits == (a_blocks[:2],) and n == 8 and mgr.num_free_blocks == 2
    # b needs 2 new blocks, and its 2 hits leave the free queue too: 4 > 2 free.
    assert mgr.allocate_slots(b, 5, hits) is None
    assert mgr.num_free_blocks == 2 and mgr.get_block_ids("b") == ([],)
    assert all(mgr.block_pool.ref_count(x) == 0 for x in hits[0])
    mgr.free(hog)
    new = mgr.allocate_slots(b, 5, hits)
    assert new is not None and len(new) == 1 and len(new[0]) == 2
    assert set(new[0]).isdisjoint(hits[0])
    assert mgr.get_block_ids("b") == (hits[0] + new[0],) and mgr.num_free_blocks == 1


def test_caching_off_never_hashes(monkeypatch) -> None:
    def boom(parent, tokens):
        raise AssertionError("hashed with prefix caching off")

    monkeypatch.setattr(block_hash, "hash_block_tokens", boom)
    mgr = KVCacheManager(num_blocks=10, block_size=4, max_model_len=64)
    prompt = list(range(100, 109))
    run_prefill(mgr, tokens_request("a", prompt))
    assert mgr.get_computed_blocks(tokens_request("b", prompt)) == (([],), 0)
    assert mgr.block_pool.num_cached_blocks == 0


def test_only_known_tokens_are_cached_and_reset_prefix_cache() -> None:
    mgr = caching_manager()
    a = tokens_request("a", list(range(100, 106)))  # 6 tokens
    assert mgr.allocate_slots(a, 6) is not None
    a.num_computed_tokens = 6
    assert mgr.block_pool.num_cached_blocks == 1
    # A decode step for position 6; positions 7.. are not known yet, block 1 is not full.
    a.append_output_token_ids(7)
    assert mgr.allocate_slots(a, 1) == ([],)
    a.num_computed_tokens = 7
    assert mgr.block_pool.num_cached_blocks == 1
    a.append_output_token_ids(8)
    assert mgr.allocate_slots(a, 1) == ([],)  # position 7 completes block 1
    assert mgr.block_pool.num_cached_blocks == 2
    assert not mgr.reset_prefix_cache()  # a still holds blocks
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.block_pool.num_cached_blocks == 0
    assert mgr.get_computed_blocks(tokens_request("b", a.all_token_ids + [1])) == (([],), 0)
