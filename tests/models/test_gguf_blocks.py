"""gguf_blocks: each integer block type's values, scales and mins against gguf.quants'
dequantization of the same bytes, the u4 packing's byte order and its inverse, the byte layout in
smaller groups (as_byte_groups) keeping every value, and the errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mrv2.models.layers.gguf_blocks import as_byte_groups, pack_u4, unpack_u4
from mrv2.models.layers.quant_formats import FORMATS

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw, reference  # noqa: E402

INTEGER_TYPES = sorted(name for name, fmt in FORMATS.items() if not fmt.is_16bit)


def unpack_blocks(blocks: np.ndarray, gguf_type: str):
    return FORMATS[gguf_type].decode(blocks)


@pytest.mark.parametrize("gguf_type", INTEGER_TYPES)
def test_values_times_scales_plus_mins_is_ggufs_dequantization(gguf_type):
    n, k = 4, 512
    raw = random_raw(gguf_type, n, k, seed=3)
    vals, scales, mins = unpack_blocks(raw.reshape(-1, FORMATS[gguf_type].block_bytes),
                                       gguf_type)
    groups = scales.shape[1]
    w = vals.astype(np.float32).reshape(-1, groups, vals.shape[1] // groups) * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    np.testing.assert_array_equal(w.reshape(n, k), reference(raw, gguf_type, n, k).numpy())


def test_pack_u4_puts_a_groups_first_16_in_low_nibbles():
    vals = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    packed = pack_u4(vals)
    assert packed.shape == (1, 32)
    for g in range(2):
        for j in range(16):
            byte = packed[0, 16 * g + j]
            assert byte & 15 == vals[0, 32 * g + j] and byte >> 4 == vals[0, 32 * g + 16 + j]


def test_unpack_u4_inverts_pack_u4():
    vals = np.random.default_rng(0).integers(0, 16, size=(3, 96), dtype=np.uint8)
    packed = pack_u4(vals)
    assert packed.shape == (3, 48)
    np.testing.assert_array_equal(unpack_u4(packed), vals)


def _dequantized(values: np.ndarray, scales: np.ndarray, mins: np.ndarray | None) -> np.ndarray:
    n, groups = scales.shape
    w = values.astype(np.float32).reshape(n, groups, -1) * scales[..., None]
    return (w if mins is None else w + mins[..., None]).reshape(n, -1)


@pytest.mark.parametrize("gguf_type, group_size", [("Q4_K", 16), ("Q4_0", 32), ("Q4_1", 16),
                                                   ("Q8_0", 16), ("Q5_K", 16), ("Q6_K", 16)])
def test_byte_groups_keep_every_value(gguf_type, group_size):
    n, k = 4, 512
    raw = random_raw(gguf_type, n, k, seed=5)
    vals, scales, mins = unpack_blocks(raw.reshape(-1, FORMATS[gguf_type].block_bytes),
                                       gguf_type)
    vals, scales = vals.reshape(n, k), scales.reshape(n, -1)
    mins = None if mins is None else mins.reshape(n, -1)
    packed = gguf_type in ("Q4_0", "Q4_1", "Q4_K")
    q = pack_u4(vals) if packed else vals
    values, wide_scales, wide_mins = as_byte_groups(q, scales, mins, packed, group_size)
    assert values.dtype == np.int8 and values.shape == (n, k)
    assert wide_scales.shape == (n, k // group_size)
    assert (wide_mins is None) == (mins is None)
    np.testing.assert_array_equal(_dequantized(values, wide_scales, wide_mins),
                                  reference(raw, gguf_type, n, k).numpy())


def test_byte_groups_refuse_a_size_that_does_not_divide_the_groups():
    q = np.zeros((2, 64), np.int8)
    with pytest.raises(ValueError, match="cannot be split"):
        as_byte_groups(q, np.ones((2, 4), np.float32), None, False, 32)  # 16-input groups
