"""The KV cache manager over a hybrid layout: windowed groups give their blocks behind the
window back as the request runs, so what a request holds is bounded by its window; prefix
hits and frees stay exact."""

from __future__ import annotations

import random

from mrv2.core.kv_cache_layout import KVCacheLayout
from mrv2.core.kv_cache_manager import KVCacheManager
from mrv2.core.request import Request
from mrv2.protocol import NULL_BLOCK_ID
from mrv2.sampling_params import SamplingParams

BS = 4
WINDOW = 6
CHUNK = 8


def manager(windows: tuple[int, ...], num_blocks: int = 200, caching: bool = False
            ) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len=512, enable_caching=caching,
                          layout=KVCacheLayout.for_windows(windows, len(windows)),
                          max_new_tokens=CHUNK)


def request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=64))


def run_prefill(mgr: KVCacheManager, req: Request, hit=None) -> list[int]:
    """Schedule the prompt in chunks of CHUNK tokens (as the scheduler does); returns the
    block ids the request held after each step."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(CHUNK, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n, hit) is not None
        if hit is not None:
            req.num_computed_tokens += len(hit[0]) * BS
            hit = None
        req.num_computed_tokens += n
        held.append(mgr.num_blocks_held(req.request_id))
    return held


def test_a_window_only_model_holds_about_a_window_of_blocks() -> None:
    mgr = manager((WINDOW, WINDOW))
    req = request("r", list(range(8 * 16)))
    held = run_prefill(mgr, req)
    bound = mgr.layout.groups[0].max_blocks(10**6, BS, CHUNK)
    assert max(held) <= bound < req.num_tokens // BS
    (blocks,) = mgr.get_block_ids("r")
    # Logical indexing is kept: the entries behind the window are the null block.
    assert len(blocks) == req.num_tokens // BS
    first_live = mgr.layout.groups[0].first_live_block(req.num_computed_tokens - CHUNK, BS)
    assert blocks[:first_live] == [NULL_BLOCK_ID] * first_live
    assert NULL_BLOCK_ID not in blocks[first_live:]
    assert mgr.num_free_blocks == 199 - mgr.num_blocks_held("r")
    mgr.free(req)
    assert mgr.num_free_blocks == 199


def test_a_hybrid_model_bounds_only_its_windowed_group() -> None:
    mgr = manager((WINDOW, 0, WINDOW, 0))
    req = request("r", list(range(100)))
    run_prefill(mgr, req)
    windowed, full = mgr.get_block_ids("r")
    assert len(windowed) == len(full) == 25
    assert NULL_BLOCK_ID not in full
    assert 0 < len([b for b in windowed if b != NULL_BLOCK_ID]) <= 6
    assert not set(windowed) & set(full) - {NULL_BLOCK_ID}
    mgr.free(req)
    assert mgr.num_free_blocks == 199


def test_decode_steps_give_back_one_block_per_block_of_tokens() -> None:
    mgr = manager((WINDOW,))
    req = request("r", list(range(10)))
    run_prefill(mgr, req)
    for _ in range(40):  # decode: one token a step
        req.append_output_token_ids(1)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        assert mgr.num_blocks_held("r") <= 3  # 6 keys span at most 3 blocks of 4
    assert mgr.num_free_blocks == 199 - mgr.num_blocks_held("r")


def test_prefix_hit_needs_only_the_window_behind_it() -> None:
    mgr = manager((WINDOW, 0), caching=True)
    prompt = list(range(40))
    a = request("a", prompt)
    run_prefill(mgr, a)
    mgr.free(a)  # registered blocks stay cached, the given-back ones too
    b = request("b", prompt + [7, 7])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 40
    windowed, full = hit
    assert NULL_BLOCK_ID not in full and len(full) == 10
    first_live = mgr.layout.groups[0].first_live_block(num_hit, BS)
    assert windowed[:first_live] == [NULL_BLOCK_ID] * first_live
    assert NULL_BLOCK_ID not in windowed[first_live:]
    run_prefill(mgr, b, hit)
    assert mgr.get_block_ids("b")[1][:10] == full


def test_prefix_hit_is_cut_back_to_where_the_window_group_has_its_blocks() -> None:
    mgr = manager((WINDOW, 0), num_blocks=40, caching=True)
    prompt = list(range(40))
    a = request("a", prompt)
    run_prefill(mgr, a)
    mgr.free(a)
    # Another request takes most of the pool: the least recently freed blocks are evicted,
    # among them windowed blocks the hit on the whole prompt would need.
    filler = request("f", [9] * 60)
    run_prefill(mgr, filler)
    b = request("b", prompt + [1])
    hit, num_hit = mgr.get_computed_blocks(b)
    assert num_hit % BS == 0 and num_hit < 40
    for g, group in enumerate(mgr.layout.groups):
        live = group.first_live_block(num_hit, BS)
        assert len(hit[g]) == num_hit // BS
        assert NULL_BLOCK_ID not in hit[g][live:]


def test_random_workload_never_loses_or_shares_a_block() -> None:
    rng = random.Random(0)
    mgr = manager((WINDOW, 0, 3, 0, WINDOW, 0), num_blocks=120, caching=True)
    live: dict[str, Request] = {}
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            req = request(f"r{step}", [rng.randrange(3) for _ in range(rng.randrange(1, 40))])
            hit, num_hit = mgr.get_computed_blocks(req)
            n = min(CHUNK, req.num_tokens - num_hit)
            if mgr.allocate_slots(req, n, hit) is not None:
                req.num_computed_tokens = num_hit + n
                live[req.request_id] = req
        for req in list(live.values()):
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token_ids(rng.randrange(3))
            n = min(CHUNK, req.num_tokens - req.num_computed_tokens)
            if req.num_tokens > 200 or mgr.allocate_slots(req, n) is None:
                mgr.free(req)
                del live[req.request_id]
                continue
            req.num_computed_tokens += n
        held = [b for rid in live for blocks in mgr.get_block_ids(rid) for b in blocks
                if b != NULL_BLOCK_ID]
        counts = {b: held.count(b) for b in held}
        for b, count in counts.items():
            assert mgr.block_pool.ref_count(b) == count
        assert mgr.num_free_blocks == 119 - len(counts)
    for req in live.values():
        mgr.free(req)
    assert mgr.num_free_blocks == 119
