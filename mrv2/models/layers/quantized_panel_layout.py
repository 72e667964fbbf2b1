"""The bytes of quantized_panel_numba's panels: a weight of integer blocks repacked, at load, into
panels of 64 outputs in one of three forms, chosen from the weight's values and tables. Numpy.

- "i8": for each pair of inputs (2 p, 2 p + 1) the 64 outputs' two weights, 128 contiguous
  bytes (panel b, pair p: w[64 b + o, 2 p + t] at byte 2 o + t); groups of 32 inputs (Q8_0,
  Q5_0, Q5_1, Q5_K) or 16 (a fused projection's bytes).
- "u4" (Q4_0, Q4_1, Q4_K): nibbles in octets of inputs: 64 bytes hold 16 outputs' 8 inputs as
  32 16-bit words, word 2 o + t carrying the octet's inputs 2 k + t in its nibble k (row 4 c + j
  of a panel: octet c of outputs 16 j .. 16 j + 15), so that a shift and a mask make the lanes
  of pair k.
- "u6" (Q6_K, and any bytes in -32..31 with 16-input groups whose scales are, per 256
  inputs, one float times int8 sub-scales): the file's 6.5 bits a weight. Per 16-input group,
  832 bytes: 3 rows of 64 bytes per 16 outputs (row 4 r + j: outputs 16 j .. 16 j + 15), word
  2 o + t of rows r = 0, 1, 2 together a 48-bit string holding input 2 m + t's value at bits
  6 m .. 6 m + 5 (two's complement), so that one shift (a funnel shift across two rows for m =
  2, 5) puts it at the top of a 16-bit lane and an arithmetic shift brings it down, sign and
  all; then the 64 outputs' int8 sub-scales. The scale table holds the float per 256 inputs
  [B, K / 256, 64]. A weight's scale is sub x super: exact in float32, so the panels hold the
  very values and scales of the "i8" form they replace.

Tables: scales [B, G, 64] and mins [B, G or 0, 64] in the weight's table dtype (float16 bit
patterns for the 32-input types, float32 for the K types); outputs past N are zeros.
"""

from __future__ import annotations

import numpy as np

from mrv2.models.layers.gguf_blocks import unpack_u4
from mrv2.models.layers.quantized_int8_numba import INT8_BLOCK

GROUP_PANEL_OUTPUTS = 64  # outputs of a panel
GROUP_PANEL_VECTORS = GROUP_PANEL_OUTPUTS // 16  # 16-output vectors of a panel
U6_PAIR_BYTES = 104  # a "u6" panel's bytes per input pair (832 per 16-input group)
U6_SUPER_GROUPS = 16  # 16-input groups sharing a "u6" super-scale (256 inputs)


def group_panels_of(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None,
                    packed: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight's blocks -> the kernel's (weights int8 [B, K / 2, 128] ("i8"), [B, K / 2, 64]
    (`packed`: "u4") or [B, K / 2, U6_PAIR_BYTES] ("u6", where the values and scales allow),
    scales [B, G (or K / 256 for "u6"), 64], mins [B, G or 0, 64]), B = ceil(N / 64).
    `q`: "i8" values int8 [N, K], or "u4" bytes uint8 [N, K / 2] (quantized.py's layout);
    `scales` / `mins` [N, G] (G = K / 32, or K / 16 for "i8") float32 or int16 float16 bit
    patterns, the panels' tables in the same dtype (mins None: no min term)."""
    n = q.shape[0]
    if packed:
        q = unpack_u4(q).astype(np.int8)
    k = q.shape[1]
    if k % INT8_BLOCK or scales.shape not in ((n, k // INT8_BLOCK),
                                              *(() if packed else ((n, k // 16),))):
        raise ValueError(f"weight {q.shape} with scales {scales.shape}: groups of 32 inputs, "
                         f"or 16 for bytes (not nibbles)")
    if scales.dtype not in (np.float32, np.int16) or (mins is not None
                                                      and mins.dtype != scales.dtype):
        raise ValueError(f"tables of {scales.dtype} / {None if mins is None else mins.dtype}: "
                         f"one dtype, float32 or int16 float16 bit patterns")
    blocks = -(-n // GROUP_PANEL_OUTPUTS)
    padded = np.zeros((blocks * GROUP_PANEL_OUTPUTS, k), np.int8)
    padded[:n] = q

    def table_panels(table: np.ndarray) -> np.ndarray:
        out = np.zeros((blocks * GROUP_PANEL_OUTPUTS, table.shape[1]), table.dtype)
        out[:n] = table
        return np.ascontiguousarray(out.reshape(blocks, GROUP_PANEL_OUTPUTS, table.shape[1])
                                    .transpose(0, 2, 1))

    no_mins = table_panels(np.zeros((n, 0), scales.dtype))
    factored = None if packed or mins is not None else _super_scales(q, scales)
    if factored is not None:
        supers, subs = factored
        padded_subs = np.zeros((blocks * GROUP_PANEL_OUTPUTS, subs.shape[1]), np.int8)
        padded_subs[:n] = subs
        return _u6_weights(padded, padded_subs), table_panels(supers), no_mins
    if packed:
        weights = _octets(padded).reshape(blocks, k // 2, -1)
    else:
        pairs = padded.reshape(blocks, GROUP_PANEL_OUTPUTS, k // 2, 2).transpose(0, 2, 1, 3)
        weights = np.ascontiguousarray(pairs).reshape(blocks, k // 2, -1)
    return weights, table_panels(scales), no_mins if mins is None else table_panels(mins)


def no_group_panels(table_dtype: type = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What `group_panels_of` returns, with no panels: a weight view's (the decode stack's)
    stand-in where the kernel does not take the weight, its tables of `table_dtype` (the
    blocks', so that views of one table dtype share one numba type)."""
    return (np.empty((0, 0, 2 * GROUP_PANEL_OUTPUTS), np.int8),
            np.empty((0, 0, GROUP_PANEL_OUTPUTS), table_dtype),
            np.empty((0, 0, GROUP_PANEL_OUTPUTS), table_dtype))


def _octets(values: np.ndarray) -> np.ndarray:
    """Values [64 B, K] in 0..15 -> "u4" rows [B, K / 8, 4, 64] int8 (octet, vector j, bytes)."""
    blocks, k = values.shape[0] // GROUP_PANEL_OUTPUTS, values.shape[1]
    # [B, vector j, output o, octet, pair k, input t] -> bytes [B, octet, j, o, t, h]:
    # nibble k & 1 of byte h = k >> 1 (word 2 o + t holds the octet's 4 pairs' inputs t)
    v = values.reshape(blocks, GROUP_PANEL_VECTORS, 16, k // 8, 2, 2, 2)
    v = v.transpose(0, 3, 1, 2, 6, 4, 5)
    return np.ascontiguousarray(v[..., 0] | (v[..., 1] << 4)).reshape(blocks, k // 8, 4, -1)


def _u6_weights(values: np.ndarray, subs: np.ndarray) -> np.ndarray:
    """Values int8 [64 B, K] in -32..31 and sub-scales int8 [64 B, K / 16] -> "u6" panels
    [B, K / 2, U6_PAIR_BYTES]: per 16-input group the 48-bit strings' 12 rows, then the 64
    sub-scales."""
    blocks, k = values.shape[0] // GROUP_PANEL_OUTPUTS, values.shape[1]
    groups = k // 16
    # [B, j, o, group, m, t] -> [B, group, j, o, t, m]: input 2 m + t at bits 6 m of a string
    fields = (values.astype(np.int64) & 63).reshape(blocks, GROUP_PANEL_VECTORS, 16, groups, 8, 2)
    strings = (fields.transpose(0, 3, 1, 2, 5, 4) << (6 * np.arange(8))).sum(-1)
    words = (strings[..., None] >> (16 * np.arange(3))) & 0xFFFF  # [B, group, j, o, t, r]
    rows = words.astype(np.uint16).transpose(0, 1, 5, 2, 3, 4)  # row 4 r + j, word 2 o + t
    rows = np.ascontiguousarray(rows).view(np.int8).reshape(blocks, groups, 12 * 64)
    sub_rows = subs.reshape(blocks, GROUP_PANEL_OUTPUTS, groups).transpose(0, 2, 1)
    out = np.concatenate([rows, sub_rows], axis=-1)
    return np.ascontiguousarray(out).reshape(blocks, k // 2, U6_PAIR_BYTES)


def _super_scales(values: np.ndarray, scales: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """Float32 scales [N, K / 16] of values int8 [N, K] -> (super-scales float32 [N, K / 256],
    int8 sub-scales [N, K / 16]) whose products are the scales bit for bit, where every value
    is in -32..31 and every 256 inputs' scales factor so (a Q6_K's do: its f16 d times int8
    scales); else None. A super-block's largest scale is its super-scale times some |sub| <=
    128 (most often 128: ggml maps it there), so each count is tried, largest first."""
    n, groups = scales.shape
    if (scales.dtype != np.float32 or groups % U6_SUPER_GROUPS or values.shape[1] != 16 * groups
            or values.min(initial=0) < -32 or values.max(initial=0) > 31
            or not np.isfinite(scales).all()):
        return None
    s = scales.reshape(n, groups // U6_SUPER_GROUPS, U6_SUPER_GROUPS)
    top = np.abs(s).max(-1)
    supers = np.zeros(top.shape, np.float32)
    subs = np.zeros(s.shape, np.int8)
    todo = np.flatnonzero(top > 0)  # all-zero super-blocks: 0 x 0
    for count in range(128, 0, -1):
        if not todo.size:
            break
        cand = top.reshape(-1)[todo] / np.float32(count)
        block = s.reshape(-1, U6_SUPER_GROUPS)[todo]
        sub = np.rint(block / cand[:, None])
        ok = ((np.abs(sub) <= 128) & (sub.astype(np.float32) * cand[:, None] == block)).all(-1)
        # a sub-scale of +128 is -128 under a negative super-scale (ggml's d may be negative)
        flip = (sub == 128).any(-1)
        ok &= ~(flip & (sub == -128).any(-1))
        cand, sub = np.where(flip, -cand, cand), np.where(flip[:, None], -sub, sub)
        supers.reshape(-1)[todo[ok]] = cand[ok]
        subs.reshape(-1, U6_SUPER_GROUPS)[todo[ok]] = sub[ok]
        todo = todo[~ok]
    return None if todo.size else (supers, subs.reshape(n, groups))
