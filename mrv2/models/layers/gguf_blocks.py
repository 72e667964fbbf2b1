"""GGUF's integer block types decoded into the kernel layouts' values and tables
(quant_formats.FORMATS names each type's decoder; quantized.PackedWeight.from_gguf calls it):
each block's values in input order with its scales and mins, the 4-bit values packed two to a
byte, and the tables kept in float16 where exact. Numpy, at load time only.

The block formats are ggml's (gguf.quants reads the same bytes; tests/models/test_quantized.py
checks PackedWeight's dequantization against it bit for bit for every type).
"""

from __future__ import annotations

import numpy as np
import torch

_QK_K = 256  # inputs per K-quant super-block


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 field at byte `start` of each block, as float32 [nb]."""
    return blocks[:, start:start + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[nb, c * width] bytes -> [nb, 2c, width] uint8: each `width` run of bytes gives its low
    nibbles, then its high nibbles (the order of Q4_0/Q4_1/Q5_x (width 16), Q4_K/Q5_K (32))."""
    nb = qs.shape[0]
    qs = qs.reshape(nb, -1, 1, width)
    return ((qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(nb, -1, width)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes -> the 8 six-bit scales and mins per super-block [nb, 8]."""
    nb = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(nb, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(nb, 8).astype(np.float32), mn.reshape(nb, 8).astype(np.float32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's little-endian 32-bit qh -> bit 4 of each of the 32 values [nb, 32]."""
    qh = qh.copy().view("<u4").reshape(-1, 1)
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


# Each decoder: blocks [nb, block_bytes] -> (values [nb, block_size] (uint8 for u4 formats,
# int8 else), scales [nb, groups], mins [nb, groups] or None), values in input order.
Blocks = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def q4_0(b: np.ndarray) -> Blocks:
    d = _f16(b, 0)[:, None]
    return _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32), d, -8.0 * d


def q4_1(b: np.ndarray) -> Blocks:
    return _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def q8_0(b: np.ndarray) -> Blocks:
    return b[:, 2:].view(np.int8), _f16(b, 0)[:, None], None


def _q5(b: np.ndarray, off: int) -> np.ndarray:
    return _nibbles(b[:, off + 4:], 16).reshape(b.shape[0], 32) | _high_bits(b[:, off:off + 4])


def q5_0(b: np.ndarray) -> Blocks:
    return (_q5(b, 2).astype(np.int16) - 16).astype(np.int8), _f16(b, 0)[:, None], None


def q5_1(b: np.ndarray) -> Blocks:
    return _q5(b, 4).astype(np.int8), _f16(b, 0)[:, None], _f16(b, 2)[:, None]


def _k_tables(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = _k_scale_min(b[:, 4:16])
    return _f16(b, 0)[:, None] * sc, -(_f16(b, 2)[:, None] * mn)


def q4_k(b: np.ndarray) -> Blocks:
    scales, mins = _k_tables(b)
    return _nibbles(b[:, 16:], 32).reshape(b.shape[0], _QK_K), scales, mins


def q5_k(b: np.ndarray) -> Blocks:
    nb = b.shape[0]
    scales, mins = _k_tables(b)
    qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _nibbles(b[:, 48:], 32) | ((qh & 1) << 4)
    return q.reshape(nb, _QK_K).astype(np.int8), scales, mins


def q6_k(b: np.ndarray) -> Blocks:
    nb = b.shape[0]
    ql = _nibbles(b[:, :128], 64).reshape(nb, 8, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1)
    q = (ql | ((qh & 3).reshape(nb, 8, 32) << 4)).astype(np.int16) - 32
    scales = _f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return q.reshape(nb, _QK_K).astype(np.int8), scales, None


# IQ4_NL's 16 non-linear levels (ggml's kvalues_iq4nl): a nibble indexes them, times d.
_IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=np.int8)


def iq4_nl(b: np.ndarray) -> Blocks:
    """Levels are integers of at most 7 bits: held as int8 values with the block's scale."""
    return _IQ4_NL_LEVELS[_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32)], _f16(b, 0)[:, None], None


# MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4): integers, against the scale halved.
_MXFP4_LEVELS = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float32 (a subnormal for e < 2)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4(b: np.ndarray) -> Blocks:
    """The e8m0 byte, then the 32 codes as Q4_0's nibbles: doubled levels, scale halved."""
    return (_MXFP4_LEVELS[_nibbles(b[:, 1:], 16).reshape(b.shape[0], 32)],
            e8m0_half(b[:, 0])[:, None], None)


def pack_u4(vals: np.ndarray) -> np.ndarray:
    """Values [N, K] in 0..15 -> the u4 layout [N, K // 2] (byte j of group g: inputs 32 g + j
    low, 32 g + 16 + j high)."""
    v = vals.reshape(vals.shape[0], -1, 2, 16)
    return (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).reshape(vals.shape[0], -1)


def unpack_u4(q: np.ndarray) -> np.ndarray:
    """The u4 layout [N, K // 2] -> its values [N, K] in 0..15, uint8 (`pack_u4`'s inverse: the
    nibble order of Q4_0's 16-byte runs)."""
    return _nibbles(q, 16).reshape(q.shape[0], -1)


def as_byte_groups(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, packed: bool,
                   group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A weight's values and tables as the "i8" layout with `group_size`-input groups (one that
    divides the weight's): the same dequantized values exactly, as 4-bit values (0..15) fit a
    byte and each table entry is repeated for the smaller groups it covers. How a fused
    projection whose shards differ in layout (Q4_K q / k with a Q6_K v, in a Q4_K_M file)
    becomes one weight."""
    values = unpack_u4(q) if packed else q
    own_group = values.shape[1] // scales.shape[1]
    if own_group % group_size:
        raise ValueError(f"{own_group}-input groups cannot be split into {group_size}-input ones")
    repeat = own_group // group_size
    scales, mins = (None if t is None else np.repeat(t, repeat, axis=1) for t in (scales, mins))
    return np.ascontiguousarray(values.view(np.int8)), scales, mins


def compact_tables(scales: np.ndarray, mins: np.ndarray | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 scale / min tables -> int16 float16 bit patterns when every value of both is
    exactly a float16 (the 32-input types' f16 fields), else float32 (a K type's products):
    the tables PackedWeight keeps."""
    tables = [t for t in (scales, mins) if t is not None]
    with np.errstate(over="ignore"):
        exact = all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in tables)
    out = [None if t is None else torch.from_numpy(
        np.ascontiguousarray(t.astype(np.float16).view(np.int16) if exact else t))
        for t in (scales, mins)]
    return out[0], out[1]
