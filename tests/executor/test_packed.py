"""executor/packed.py: the compact per-step encodings round-trip exactly and refuse what they
cannot represent."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.packed import (check_id, int32_bytes, int32_view, is_id_prefix, ones_int32_bytes,
                             pack_ids, pack_ragged, unpack_ids, unpack_ragged)

# What request ids may hold (mrv2/packed.check_id): no NUL, no lone surrogate.
PACKABLE = st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))
ids = st.lists(st.text(PACKABLE, max_size=8), max_size=10)
int32s = st.integers(-2**31, 2**31 - 1)


@settings(max_examples=200, deadline=None)
@given(ids)
def test_ids_round_trip(req_ids: list[str]) -> None:
    assert unpack_ids(pack_ids(req_ids), len(req_ids)) == req_ids


def test_empty_and_single_empty_id_are_told_apart_by_the_count() -> None:
    assert pack_ids([]) == pack_ids([""]) == b""
    assert unpack_ids(b"", 0) == [] and unpack_ids(b"", 1) == [""]
    with pytest.raises(ValueError, match="hold 2 ids, expected 3"):
        unpack_ids(b"a\0b", 3)


def test_an_id_that_cannot_travel_packed_is_refused() -> None:
    with pytest.raises(ValueError, match="NUL"):
        pack_ids(["ok", "bad\0id"])
    with pytest.raises(ValueError, match="NUL"):
        check_id("bad\0id")
    with pytest.raises(ValueError, match="UTF-8"):
        check_id("bad\ud800")
    check_id("cmpl-\u00e9-0")


@settings(max_examples=200, deadline=None)
@given(ids, st.integers(0, 10))
def test_is_id_prefix_matches_list_prefix(req_ids: list[str], k: int) -> None:
    k = min(k, len(req_ids))
    packed = pack_ids(req_ids)
    assert is_id_prefix(packed, len(req_ids), pack_ids(req_ids[:k]), k)
    other = [*req_ids[:k], "zz-not-there"]
    assert is_id_prefix(packed, len(req_ids), pack_ids(other), k + 1) == (
        req_ids[:k + 1] == other)


def test_is_id_prefix_does_not_match_a_longer_id() -> None:
    # "a\0bc" starts with "a\0b" as a string, but ["a", "b"] is not a prefix of ["a", "bc"].
    assert not is_id_prefix(pack_ids(["a", "bc", "d"]), 3, pack_ids(["a", "b"]), 2)
    assert not is_id_prefix(pack_ids(["a", "bc"]), 2, pack_ids(["a", "b"]), 2)
    assert is_id_prefix(pack_ids(["a", "b", "c"]), 3, pack_ids(["a", "b"]), 2)


@given(st.lists(int32s, max_size=50))
def test_int32_bytes_round_trip(values: list[int]) -> None:
    data = int32_bytes(values)
    assert int32_view(data).tolist() == values
    assert int32_bytes(np.array(values, dtype=np.int64)) == data  # narrowed, exactly
    assert not int32_view(data).flags.writeable  # a view of a frozen message


def test_int32_bytes_refuses_values_outside_int32() -> None:
    with pytest.raises(OverflowError):
        int32_bytes([2**31])
    with pytest.raises(OverflowError):
        int32_bytes(np.array([-2**31 - 1], dtype=np.int64))


def test_ones() -> None:
    assert int32_view(ones_int32_bytes(5)).tolist() == [1] * 5
    assert ones_int32_bytes(0) == b""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(int32s, max_size=4), max_size=10))
def test_ragged_round_trip(lists: list[list[int]]) -> None:
    flat, counts = pack_ragged(lists)
    assert unpack_ragged(int32_view(flat), int32_view(counts)) == lists
