"""Compact per-step encodings for the protocol structs (DESIGN.md section 3).

A step message names every running request, so its cost is dominated by per-request Python
objects: 256 id strings, 256 small lists, a dict keyed by the ids. The step-path structs
therefore carry

- request ids as one UTF-8 ``bytes``, the ids joined by NUL (``pack_ids``): one msgpack bin,
  decoded as one object without UTF-8 validation (a third of a str's cost); consumers that
  need a list decode and split it once, in C (``unpack_ids``). Ids never contain NUL:
  ``pack_ids`` refuses one, and the scheduler refuses such a request at admission.
- per-request integers as little-endian int32 ``bytes`` (``int32_bytes`` / ``int32_view``):
  one msgpack bin, read back as a read-only numpy view (no copy, and the frozen message cannot
  be mutated through it). Plain bytes keep `==`, pickle and any msgpack encoder working.
- ragged per-request lists (new block ids, sampled tokens) as one flat int32 array plus an
  int32 count per request (``pack_ragged`` / ``unpack_ragged``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

ID_SEP = "\0"
_ID_SEP_BYTES = ID_SEP.encode()
_INT32 = np.dtype("<i4")
_ONE_INT32 = np.ones(1, dtype=_INT32).tobytes()


def check_id(req_id: str) -> None:
    """ValueError unless `req_id` can travel packed: no NUL, valid UTF-8 (no lone surrogate)."""
    if ID_SEP in req_id:
        raise ValueError(f"request id {req_id!r} contains a NUL character")
    try:
        req_id.encode()
    except UnicodeEncodeError as e:
        raise ValueError(f"request id {req_id!r} is not valid UTF-8: {e}") from None


def pack_ids(ids: Sequence[str]) -> bytes:
    """The ids joined by NUL, UTF-8; ValueError if one contains NUL (it would split in two)."""
    packed = ID_SEP.join(ids)
    if packed.count(ID_SEP) != max(len(ids) - 1, 0):
        bad = next(i for i in ids if ID_SEP in i)
        raise ValueError(f"request id {bad!r} contains a NUL character")
    return packed.encode()


def unpack_ids(packed: bytes, count: int) -> list[str]:
    """Inverse of `pack_ids` for `count` ids (b"" packs both [] and [""]: the count decides)."""
    if count == 0:
        return []
    ids = packed.decode().split(ID_SEP)
    if len(ids) != count:
        raise ValueError(f"packed request ids hold {len(ids)} ids, expected {count}")
    return ids


def is_id_prefix(packed: bytes, count: int, prefix: bytes, prefix_count: int) -> bool:
    """Whether the first `prefix_count` ids of `packed` are the ids of `prefix`."""
    if prefix_count == 0:
        return True
    if prefix_count == count:
        return packed == prefix
    return prefix_count < count and packed.startswith(prefix + _ID_SEP_BYTES)


def int32_bytes(values: Iterable[int] | np.ndarray) -> bytes:
    """Little-endian int32 bytes of `values`; OverflowError/ValueError outside int32."""
    if isinstance(values, np.ndarray):
        arr = values
        if arr.dtype != _INT32:
            checked = arr.astype(_INT32)
            if not np.array_equal(checked, arr):
                raise OverflowError("value outside int32")
            arr = checked
        return arr.tobytes()
    return np.array(values if isinstance(values, (list, tuple)) else list(values),
                    dtype=_INT32).tobytes()


def ones_int32_bytes(n: int) -> bytes:
    """`int32_bytes([1] * n)`, without building the list (one count per request, the common
    case of sampled tokens)."""
    return _ONE_INT32 * n


def int32_view(data: bytes) -> np.ndarray:
    """Read-only int32 view of `int32_bytes` output (no copy)."""
    return np.frombuffer(data, dtype=_INT32)


def pack_ragged(lists: Sequence[Sequence[int]]) -> tuple[bytes, bytes]:
    """(flat int32 bytes, per-list int32 counts) of a list of int lists."""
    counts = np.fromiter(map(len, lists), dtype=_INT32, count=len(lists))
    flat = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=int(counts.sum()))
    return int32_bytes(flat), counts.tobytes()


def unpack_ragged(flat: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """Inverse of `pack_ragged` (the list-of-lists view, for consumers off the step path)."""
    if len(counts) and (counts == 1).all():
        return flat.reshape(-1, 1).tolist()
    values = flat.tolist()
    ends = np.cumsum(counts).tolist()
    starts = [0, *ends[:-1]]
    return [values[s:e] for s, e in zip(starts, ends)]
