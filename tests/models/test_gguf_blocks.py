"""gguf_blocks: each integer block type's values, scales and mins against gguf.quants'
dequantization of the same bytes, the u4 packing's byte order, and the error for other types."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mrv2.models.layers.gguf_blocks import pack_u4, unpack_blocks

sys.path.insert(0, str(Path(__file__).parent))
from test_quantized import random_raw, reference  # noqa: E402

INTEGER_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("gguf_type", INTEGER_TYPES)
def test_values_times_scales_plus_mins_is_ggufs_dequantization(gguf_type):
    n, k = 4, 512
    raw = random_raw(gguf_type, n, k, seed=3)
    block_bytes = raw.size // (n * k // (256 if gguf_type.endswith("K") else 32))
    vals, scales, mins = unpack_blocks(raw.reshape(-1, block_bytes), gguf_type)
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


def test_other_types_are_refused():
    with pytest.raises(ValueError, match="F16"):
        unpack_blocks(np.zeros((1, 64), np.uint8), "F16")
