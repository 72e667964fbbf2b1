"""The bytes of quantized_panel_numba's panels: a weight of integer blocks repacked, at load, into
panels of 64 outputs in one of four forms, chosen from the weight's values and tables (numpy),
and read back as float32 rows (`panel_rows`: the embedding lookup of a weight held as its
panels) and transposed tiles (`panel_tile_t`: the prefill tiles), exactly as the blocks'
dequantization gives them (numba, on the calling thread).

- "i8": for each pair of inputs (2 p, 2 p + 1) the 64 outputs' two weights, 128 contiguous
  bytes (panel b, pair p: w[64 b + o, 2 p + t] at byte 2 o + t); groups of 32 inputs (Q8_0,
  Q5_0, Q5_1, Q5_K) or 16 (a fused projection's bytes).
- "u4" (Q4_0, Q4_1, Q4_K): nibbles in octets of inputs: 64 bytes hold 16 outputs' 8 inputs as
  32 16-bit words, word 2 o + t carrying the octet's inputs 2 k + t in its nibble k (row 4 c + j
  of a panel: octet c of outputs 16 j .. 16 j + 15), so that a shift and a mask make the lanes
  of pair k. Without a min table the values are q - 8 (Q4_0, whose mins are -8 x its scales:
  the kernel subtracts 8 x x's block sums from its integer sums instead of reading 2 bytes
  more per 32 weights).
- "u4k" (Q4_K: scales and mins that are, per 256 inputs, a float times int8 sub-scales): per
  32-input group, 1152 bytes: the four octets' "u4" rows, then the 64 outputs' int8
  sub-scales and sub-mins; the tables hold the two floats per 256 inputs [B, K / 256, 64]
  (4.5 bits a weight, the file's, where float32 tables per 32 made it 6).
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
from numba import njit

from mrv2.models.layers.gguf_blocks import unpack_u4
from mrv2.models.layers.quantized_int8_numba import INT8_BLOCK
from mrv2.models.layers.vector_ir import table_value
from mrv2.utils.kernel_flags import FASTMATH

GROUP_PANEL_OUTPUTS = 64  # outputs of a panel
GROUP_PANEL_VECTORS = GROUP_PANEL_OUTPUTS // 16  # 16-output vectors of a panel
U6_PAIR_BYTES = 104  # a "u6" panel's bytes per input pair (832 per 16-input group)
U6_SUPER_GROUPS = 16  # 16-input groups sharing a "u6" super-scale (256 inputs)
U4K_PAIR_BYTES = 72  # a "u4k" panel's bytes per input pair (1152 per 32-input group)
U4K_SUPER_GROUPS = 8  # 32-input groups sharing a "u4k" super-scale and super-min


def group_panels_of(q: np.ndarray, scales: np.ndarray, mins: np.ndarray | None,
                    packed: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight's blocks -> the kernel's (weights int8 [B, K / 2, 128] ("i8"), [B, K / 2, 64]
    (`packed`: "u4"), [B, K / 2, U6_PAIR_BYTES] ("u6") or [B, K / 2, U4K_PAIR_BYTES] ("u4k"),
    the last two where the values and tables allow, scales [B, G (or K / 256 for "u6" and
    "u4k"), 64], mins [B, G (K / 256 for "u4k") or 0, 64]), B = ceil(N / 64).
    `q`: "i8" values int8 [N, K], or "u4" bytes uint8 [N, K / 2] (quantized.py's layout);
    `scales` / `mins` [N, G] (G = K / 32, or K / 16 for "i8") float32 or int16 float16 bit
    patterns, the panels' tables in the same dtype (mins None: no min term, "i8" only; a "u4"
    weight's mins that are -8 x its scales (Q4_0's) are dropped, the kernels taking q - 8)."""
    n = q.shape[0]
    if packed and mins is None:
        raise ValueError('"u4" values are unsigned: they take a min table')
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
    if packed and mins is not None and np.array_equal(_as_float(mins), -8 * _as_float(scales)):
        mins = None  # Q4_0's: the kernels take "u4" without a min table as q - 8

    def padded_subs(subs: np.ndarray) -> np.ndarray:
        out = np.zeros((blocks * GROUP_PANEL_OUTPUTS, subs.shape[1]), np.int8)
        out[:n] = subs
        return out

    if (not packed and mins is None and scales.shape[1] == k // 16
            and q.min(initial=0) >= -32 and q.max(initial=0) <= 31):
        factored = _super_scales(scales, U6_SUPER_GROUPS)
        if factored is not None:
            return (_u6_weights(padded, padded_subs(factored[1])), table_panels(factored[0]),
                    no_mins)
    if packed and mins is not None:
        factored = [_super_scales(t, U4K_SUPER_GROUPS) for t in (scales, mins)]
        if None not in factored:
            (supers, subs), (min_supers, min_subs) = factored
            weights = np.concatenate([
                _octets(padded).reshape(blocks, k // 32, -1),
                *(padded_subs(t).reshape(blocks, GROUP_PANEL_OUTPUTS, -1).transpose(0, 2, 1)
                  for t in (subs, min_subs))], axis=-1)
            return (np.ascontiguousarray(weights).reshape(blocks, k // 2, U4K_PAIR_BYTES),
                    table_panels(supers), table_panels(min_supers))
    if packed:
        weights = _octets(padded).reshape(blocks, k // 2, -1)
    else:
        pairs = padded.reshape(blocks, GROUP_PANEL_OUTPUTS, k // 2, 2).transpose(0, 2, 1, 3)
        weights = np.ascontiguousarray(pairs).reshape(blocks, k // 2, -1)
    return weights, table_panels(scales), no_mins if mins is None else table_panels(mins)


def _as_float(table: np.ndarray) -> np.ndarray:
    """A table's float32 values (int16: float16 bit patterns)."""
    return table.view(np.float16).astype(np.float32) if table.dtype == np.int16 else table


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


def _super_scales(table: np.ndarray, per_super: int
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """A float32 table [N, G] -> (super-scales float32 [N, G / per_super], int8 sub-scales
    [N, G]) whose products are the table bit for bit, where every `per_super` groups' entries
    factor so (a Q6_K's scales, a Q4_K's scales and mins do: an f16 field times small
    integers); else None. A super-block's largest entry is its super-scale times some |sub| <=
    128 (most often the largest: ggml maps it there), so each count is tried, largest first."""
    n, groups = table.shape
    if table.dtype != np.float32 or groups % per_super or not np.isfinite(table).all():
        return None
    s = table.reshape(n, groups // per_super, per_super)
    top = np.abs(s).max(-1)
    supers = np.zeros(top.shape, np.float32)
    subs = np.zeros(s.shape, np.int8)
    todo = np.flatnonzero(top > 0)  # all-zero super-blocks: 0 x 0
    for count in range(128, 0, -1):
        if not todo.size:
            break
        cand = top.reshape(-1)[todo] / np.float32(count)
        block = s.reshape(-1, per_super)[todo]
        sub = np.rint(block / cand[:, None])
        ok = ((np.abs(sub) <= 128) & (sub.astype(np.float32) * cand[:, None] == block)).all(-1)
        # a sub-scale of +128 is -128 under a negative super-scale (ggml's d may be negative)
        flip = (sub == 128).any(-1)
        ok &= ~(flip & (sub == -128).any(-1))
        cand, sub = np.where(flip, -cand, cand), np.where(flip[:, None], -sub, sub)
        supers.reshape(-1)[todo[ok]] = cand[ok]
        subs.reshape(-1, per_super)[todo[ok]] = sub[ok]
        todo = todo[~ok]
    return None if todo.size else (supers, subs.reshape(n, groups))


@njit(inline="always")
def _group_byte(w, b, g, x):
    """Byte x of panel b's group g in a form whose groups have their own bytes ("u6": 8 pairs,
    "u4k": 16), as a uint8."""
    group_pairs = 8 if w.shape[2] == U6_PAIR_BYTES else 16
    return np.uint8(w[b, group_pairs * g + x // w.shape[2], x % w.shape[2]])


@njit(inline="always")
def _panel_value(w, b, pair, o, t, packed):
    """The integer weight of output 64 b + o, input 2 pair + t, from its panel."""
    if w.shape[2] == U4K_PAIR_BYTES:  # octet c of group g: its bytes 256 c ..
        k = pair % 4
        byte = np.int32(_group_byte(w, b, pair // 16, 256 * (pair % 16 // 4) + 64 * (o // 16)
                                    + 4 * (o % 16) + 2 * t + (k >> 1)))
        return np.float32((byte >> 4) if k & 1 else (byte & 15))
    if w.shape[2] == U6_PAIR_BYTES:  # byte x of group g: w[b, 8 g + x // 104, x % 104]
        g, m = pair // 8, pair % 8
        string = np.int64(0)
        for r in range(3):  # word 2 (o % 16) + t of row 4 r + o // 16
            at = 64 * (4 * r + o // 16) + 4 * (o % 16) + 2 * t
            piece = (np.int64(np.uint8(w[b, 8 * g + at // U6_PAIR_BYTES, at % U6_PAIR_BYTES]))
                     | np.int64(np.uint8(w[b, 8 * g + (at + 1) // U6_PAIR_BYTES,
                                           (at + 1) % U6_PAIR_BYTES])) << 8)
            string |= piece << (16 * r)
        field = (string >> (6 * m)) & 63
        return np.float32(field - 64 if field >= 32 else field)
    if packed:  # `group_panels_of`'s octets: row 4 octet + o // 16, word 2 (o % 16) + t
        k = pair % 4
        byte = np.int32(np.uint8(w[b, pair - k + o // 16, 4 * (o % 16) + 2 * t + (k >> 1)]))
        return np.float32((byte >> 4) if k & 1 else (byte & 15))
    return np.float32(w[b, pair, 2 * o + t])


@njit(inline="always")
def _panel_groups(w, scales):
    """A panel weight's weight groups and their input pairs: 8 for "u6", 16 for "u4k", else
    the table's."""
    groups = (w.shape[1] // 8 if w.shape[2] == U6_PAIR_BYTES else w.shape[1] // 16
              if w.shape[2] == U4K_PAIR_BYTES else scales.shape[1])
    return groups, w.shape[1] // max(groups, 1)


@njit(inline="always")
def _group_scale(w, scales, b, g, o):
    """Output 64 b + o's scale in group g: a sub-scale (byte 768 + o of a "u6" group, 1024 + o
    of a "u4k" one) x its super-scale, else the table's."""
    if w.shape[2] == U6_PAIR_BYTES:
        sub = np.int8(_group_byte(w, b, g, 768 + o))
        return np.float32(sub) * table_value(scales[b], g // U6_SUPER_GROUPS, o)
    if w.shape[2] == U4K_PAIR_BYTES:
        sub = np.int8(_group_byte(w, b, g, 1024 + o))
        return np.float32(sub) * table_value(scales[b], g // U4K_SUPER_GROUPS, o)
    return table_value(scales[b], g, o)


@njit(inline="always")
def _group_min(w, mins, b, g, o):
    """Output 64 b + o's min in group g: "u4k"'s sub-min (byte 1088 + o) x its super-min, else
    the table's."""
    if w.shape[2] == U4K_PAIR_BYTES:
        sub = np.int8(_group_byte(w, b, g, 1088 + o))
        return np.float32(sub) * table_value(mins[b], g // U4K_SUPER_GROUPS, o)
    return table_value(mins[b], g, o)


@njit(inline="always")
def _offset_term(scale, packed):
    """The min term of a weight without a min table: -8 x scale for "u4" (Q4_0's q - 8: s q -
    8 s is s (q - 8) exactly, 15 bits), none else."""
    return np.float32(-8.0) * scale if packed else np.float32(0.0)


@njit(fastmath=FASTMATH, cache=True)
def panel_rows(w, scales, mins, packed, ids, out):
    """out[i, :] = the float32 weight row ids[i] of a weight held as its panels, on the calling
    thread: scale x q (+ min), the value quantized_numba's dequantization gives from the
    blocks (scale x q rounded once, as there)."""
    has_min = mins.shape[1] > 0
    groups, group_pairs = _panel_groups(w, scales)
    for i in range(ids.shape[0]):
        b, o = ids[i] // GROUP_PANEL_OUTPUTS, ids[i] % GROUP_PANEL_OUTPUTS
        for g in range(groups):
            s = _group_scale(w, scales, b, g, o)
            mn = _group_min(w, mins, b, g, o) if has_min else _offset_term(s, packed)
            for pair in range(g * group_pairs, (g + 1) * group_pairs):
                for t in range(2):
                    out[i, 2 * pair + t] = s * _panel_value(w, b, pair, o, t, packed) + mn


@njit(fastmath=FASTMATH, cache=True)
def panel_tile_t(w, scales, mins, packed, b0, count, out_t):
    """out_t[:, :64 count] ([K, >= 64 count]) = the float32 weights of panels b0 .. b0 + count
    - 1, transposed (column 64 (b - b0) + o: output 64 b + o), as `panel_rows` gives them; on
    the calling thread (the tiled linear alternates it with torch.mm). Each panel is read in
    order, each input's 64 outputs written side by side."""
    has_min = mins.shape[1] > 0
    groups, group_pairs = _panel_groups(w, scales)
    u6, u4k = w.shape[2] == U6_PAIR_BYTES, w.shape[2] == U4K_PAIR_BYTES
    s = np.empty(GROUP_PANEL_OUTPUTS, np.float32)  # a group's 64 scales and mins, widened once
    mn = np.zeros(GROUP_PANEL_OUTPUTS, np.float32)
    for c in range(count):
        b, col = b0 + c, c * GROUP_PANEL_OUTPUTS
        lanes = w[b].view(np.uint32).reshape(-1)  # "u4": 16 a 64-byte row; "u4k": 288 a group
        flat = w[b].reshape(-1)
        for g in range(groups):
            # `_group_scale` / `_group_min` per output, their form branches inside this loop,
            # kept it scalar (slower tiles: bench/README.md): the forms' loops written out here
            if u6 or u4k:  # sub-scales (and sub-mins) contiguous in the group's bytes
                at = g * group_pairs * w.shape[2] + (768 if u6 else 1024)
                per_super = U6_SUPER_GROUPS if u6 else U4K_SUPER_GROUPS
                for o in range(GROUP_PANEL_OUTPUTS):
                    s[o] = np.float32(flat[at + o]) * table_value(scales[b], g // per_super, o)
                    if u4k:
                        mn[o] = (np.float32(flat[at + GROUP_PANEL_OUTPUTS + o])
                                 * table_value(mins[b], g // per_super, o))
            else:
                for o in range(GROUP_PANEL_OUTPUTS):
                    s[o] = table_value(scales[b], g, o)
                    mn[o] = (table_value(mins[b], g, o) if has_min
                             else _offset_term(s[o], packed))
            if u6:
                _u6_rows_t(lanes[g * U6_PAIR_BYTES * 2:(g + 1) * U6_PAIR_BYTES * 2], s,
                           out_t[16 * g:16 * g + 16], col)
                continue
            if packed:
                for first in range(g * group_pairs, (g + 1) * group_pairs, 4):
                    at = 288 * g + 16 * (first - g * group_pairs) if u4k else 16 * first
                    _octet_rows_t(lanes[at:at + GROUP_PANEL_OUTPUTS], first, s, mn, out_t, col)
                continue
            for pair in range(g * group_pairs, (g + 1) * group_pairs):
                for t in range(2):
                    for o in range(GROUP_PANEL_OUTPUTS):
                        out_t[2 * pair + t, col + o] = (s[o] * _panel_value(w, b, pair, o, t,
                                                                            packed) + mn[o])


@njit(inline="always")
def _u6_rows_t(group_lanes, s, out_t, col):
    """out_t[i, col:col + 64] = scale x q of a "u6" panel's 64 outputs for the 16 inputs i of
    a group, its 832 bytes as 208 uint32 lanes: lane 64 r + 16 j + o holds piece r of output
    16 j + o's strings (t = 0 in its low 16 bits, 1 in its high), input 2 m + t at bit 6 m."""
    for t in range(2):
        shift = np.uint32(16 * t)
        strings = np.empty(GROUP_PANEL_OUTPUTS, np.int64)
        for o in range(GROUP_PANEL_OUTPUTS):
            strings[o] = 0
            for r in range(3):
                strings[o] |= np.int64((group_lanes[64 * r + o] >> shift) & np.uint32(0xFFFF)
                                       ) << (16 * r)
        for m in range(8):
            dst = out_t[2 * m + t, col:col + GROUP_PANEL_OUTPUTS]
            for o in range(GROUP_PANEL_OUTPUTS):
                field = np.int32((strings[o] >> (6 * m)) & 63)
                dst[o] = s[o] * np.float32(field - ((field & 32) << 1))


@njit(inline="always")
def _octet_rows_t(src, first, s, mn, out_t, col):
    """out_t[8 c + i, col:col + 64] = scale x q + min of a "u4" / "u4k" panel's 64 outputs,
    for the 8 inputs i of the octet c whose pairs start at `first` (= 4 c). `src`: its 4 rows
    as 64 contiguous uint32 lanes, lane 16 j + o holding output 16 j + o's input 2 k + t at bit
    16 t + 4 k: each input's outputs a shift and a mask of the same lanes. (A slice, so that
    the indices are known non-negative: no wraparound selects, which LLVM turns into gathers.)"""
    for k in range(4):
        for t in range(2):
            shift = np.uint32(16 * t + 4 * k)
            dst = out_t[2 * (first + k) + t, col:col + GROUP_PANEL_OUTPUTS]
            for o in range(GROUP_PANEL_OUTPUTS):
                dst[o] = s[o] * np.float32(np.int32((src[o] >> shift) & np.uint32(15))) + mn[o]
