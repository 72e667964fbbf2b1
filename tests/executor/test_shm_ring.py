"""executor/shm_ring.py: a message's layout in a chunk (header, 16-byte aligned frames) splits
back into the same frames; the one-frame header is the general one for a count of 1."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from executor.shm_ring import (MESSAGE_HEADER, ONE_FRAME_AT, ONE_FRAME_HEADER, layout_frames,
                               message_header, split_frames)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5), st.integers(0, 2**40))
def test_layout_then_split_gives_the_frames_back(frames: list[bytes], seq: int) -> None:
    views, offsets, end = layout_frames(frames)
    chunk = bytearray(end)
    message_header(len(views)).pack_into(chunk, 0, seq, end, len(views), *map(len, views))
    for v, o in zip(views, offsets):
        assert o % 16 == 0
        chunk[o:o + len(v)] = v
    assert MESSAGE_HEADER.unpack_from(chunk)[:3] == (seq, end, len(frames))
    assert [bytes(f) for f in split_frames(memoryview(chunk), len(frames))] == frames


def test_one_frame_header_is_the_count_1_header() -> None:
    assert ONE_FRAME_HEADER.format == message_header(1).format
    assert ONE_FRAME_AT == 32 and layout_frames([b"abc"])[1] == [ONE_FRAME_AT]
