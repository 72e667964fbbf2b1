"""KV cache groups from the layers' windows (core/kv_cache_layout.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mrv2.core.kv_cache_layout import (MAX_KV_CACHE_GROUPS, KVCacheGroup, KVCacheLayout,
                                       layer_kv_shape, layer_kv_sources, layer_kv_widths,
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


def test_layers_of_different_widths_get_groups_of_their_own_and_a_block_scale() -> None:
    # Gemma 4: windowed layers 2 kv heads x 16, global layers 2 x 32.
    windows, widths = (8, 8, 0, 8, 0), (32, 32, 64, 32, 64)
    layout = KVCacheLayout.for_windows(windows, 5, widths=widths)
    assert [(g.window, g.block_scale) for g in layout.groups] == [(8, 2), (8, 2), (0, 1)]
    assert layout.group_block_scales == (2, 2, 1)
    with pytest.raises(ValueError, match="each must divide the widest"):
        KVCacheLayout.for_windows(None, 2, widths=(32, 48))


def test_one_width_keeps_every_group_at_scale_one() -> None:
    layout = KVCacheLayout.for_windows((8, 0, 8, 0), 4, widths=(32,) * 4)
    assert layout.group_block_scales == (1, 1)


def test_too_many_groups_fall_back_to_one_group_per_width() -> None:
    windows = (4,) + (0,) * (MAX_KV_CACHE_GROUPS + 1)
    widths = (16,) + (32,) * (MAX_KV_CACHE_GROUPS + 1)
    layout = KVCacheLayout.for_windows(windows, len(windows), widths=widths)
    assert [(g.window, g.layers, g.block_scale) for g in layout.groups] == [
        (4, (0,), 2), (0, tuple(range(1, len(windows))), 1)]


def test_kv_shared_layers_read_their_sources_group_and_tensor() -> None:
    layout = KVCacheLayout.for_windows((8, 0, 8, 0), 4, sources=(0, 1, 0, 1))
    assert layout.groups == (KVCacheGroup(8, (0,)), KVCacheGroup(0, (1,)))
    assert layout.layer_group == (0, 1, 0, 1) and layout.layer_tensor == (0, 0, 0, 0)
    assert layout.num_tensors == 1 and layout.layer_source == (0, 1, 0, 1)
    with pytest.raises(ValueError, match="must read a layer that owns its cache"):
        KVCacheLayout.for_windows(None, 3, sources=(0, 0, 1))


def test_gemma4_config_gives_widths_and_sources() -> None:
    from transformers import Gemma4TextConfig

    types = ["sliding_attention", "sliding_attention", "full_attention",
             "sliding_attention", "full_attention"]
    hf = Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                          attention_k_eq_v=True, sliding_window=4, layer_types=types,
                          num_kv_shared_layers=2, hidden_size_per_layer_input=0)
    assert [layer_kv_shape(hf, i) for i in range(5)] == [(2, 8), (2, 8), (1, 16), (2, 8),
                                                         (1, 16)]
    assert layer_kv_widths(hf) is None  # 2 x 8 == 1 x 16: one width
    # Layers 3 and 4 reuse the last earlier layer of their type: 1 (windowed), 2 (global).
    assert layer_kv_sources(hf) == (0, 1, 2, 1, 2)
    layout = KVCacheLayout.for_model(hf)
    assert layout.layer_group[3] == layout.layer_group[1]
    assert layout.layer_tensor[4] == layout.layer_tensor[2]
