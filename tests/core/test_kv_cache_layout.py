"""KV cache groups from the layers' windows (core/kv_cache_layout.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mrv2.core.kv_cache_layout import (MAX_KV_CACHE_GROUPS, KVCacheGroup, KVCacheLayout,
                                       layer_windows)


def test_no_window_is_one_group_of_every_layer() -> None:
    layout = KVCacheLayout.for_windows(None, 5)
    assert layout.groups == (KVCacheGroup(0, (0, 1, 2, 3, 4)),)
    assert layout.num_tensors == 5 and not layout.is_hybrid
    assert layout.layer_tensor == (0, 1, 2, 3, 4) and layout.layer_group == (0,) * 5


def test_one_window_for_every_layer_is_one_windowed_group() -> None:
    layout = KVCacheLayout.for_windows((16,) * 3, 3)
    assert layout.groups == (KVCacheGroup(16, (0, 1, 2)),)
    assert layout.num_tensors == 3


def test_alternating_layers_share_tensors_pairwise() -> None:
    # Gemma 2: sliding, full, sliding, full.
    layout = KVCacheLayout.for_windows((8, 0, 8, 0), 4)
    assert layout.groups == (KVCacheGroup(8, (0, 2)), KVCacheGroup(0, (1, 3)))
    assert layout.num_tensors == 2
    assert layout.layer_group == (0, 1, 0, 1)
    # Layer 0 and layer 1 hold their K/V in one tensor: a block id is a block of each.
    assert layout.layer_tensor == (0, 0, 1, 1)


def test_gemma3_pattern_splits_the_windowed_layers_into_groups_of_the_full_count() -> None:
    windows = tuple(0 if i % 6 == 5 else 512 for i in range(26))  # 22 windowed, 4 full
    layout = KVCacheLayout.for_windows(windows, 26)
    assert layout.num_tensors == 4
    assert [g.window for g in layout.groups] == [512] * 6 + [0]
    assert sorted(sum((g.layers for g in layout.groups), ())) == list(range(26))
    assert all(len(g.layers) == 4 for g in layout.groups[:5]) and len(layout.groups[5].layers) == 2
    # Every layer's (group, tensor) is its own: no two layers of one group share a tensor.
    pairs = set(zip(layout.layer_group, layout.layer_tensor))
    assert len(pairs) == 26


def test_too_many_groups_fall_back_to_one_group_that_keeps_every_block() -> None:
    windows = (4,) + (0,) * (MAX_KV_CACHE_GROUPS + 1)
    layout = KVCacheLayout.for_windows(windows, len(windows))
    assert layout.groups == (KVCacheGroup(0, tuple(range(len(windows)))),)


def test_window_bounds() -> None:
    group = KVCacheGroup(window=10, layers=(0,))
    # A query at position 25 sees keys 16..25: blocks of 4 from block 4 (keys 16..19) on.
    assert group.first_live_block(25, 4) == 4
    assert group.first_live_block(9, 4) == 0
    assert KVCacheGroup(0, (0,)).first_live_block(1000, 4) == 0
    # 9 keys behind a chunk of up to 8 tokens: 17 positions, at most 6 blocks of 4.
    assert group.max_blocks(10_000, 4, 8) == 6
    assert group.max_blocks(12, 4, 8) == 3  # a short request holds all of its blocks
    assert KVCacheGroup(0, (0,)).max_blocks(10_000, 4, 8) == 2500
    layout = KVCacheLayout.for_windows((10, 0), 2)
    assert layout.max_blocks_per_request(10_000, 4, 8) == 2500 + 6


def test_layer_windows_read_as_transformers_applies_them() -> None:
    assert layer_windows(SimpleNamespace(num_hidden_layers=2)) is None
    assert layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=8)) == (8, 8)
    assert layer_windows(SimpleNamespace(num_hidden_layers=2, sliding_window=8,
                                         use_sliding_window=False)) is None
    hf = SimpleNamespace(num_hidden_layers=2, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
    assert layer_windows(hf) == (8, 0)
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows(SimpleNamespace(num_hidden_layers=1, sliding_window=8,
                                      layer_types=["chunked_attention"]))
