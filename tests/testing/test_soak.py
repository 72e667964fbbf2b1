"""The soak driver's parts that need no server: RSS from /proc and the growth arithmetic (the
soak itself runs against the shared server in tests/entrypoints/openai/test_soak.py)."""

from __future__ import annotations

import mmap
import os

import pytest

from mrv2.testing.soak import REQUEST_KINDS, SoakResult, rss_bytes


def test_rss_of_this_process_grows_with_touched_memory():
    # A fresh anonymous mapping, each page written: new resident pages whatever the heap
    # holds (a bytearray could reuse pages a long test process freed but kept resident).
    size = 64 << 20
    block = mmap.mmap(-1, size)
    before = rss_bytes(os.getpid())
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    after = rss_bytes(os.getpid())
    assert 32 << 20 < after - before < 128 << 20
    block.close()


def test_rss_of_a_missing_process_raises():
    with pytest.raises(OSError):
        rss_bytes(2**22 + 1)  # above the kernel's pid_max default


def test_growth_is_measured_from_the_first_sample_at_or_after_warmup():
    result = SoakResult(samples=[(0, {"core": 50}), (100, {"core": 100}),
                                 (200, {"core": 104}), (300, {"core": 102})])
    assert result.growth("core", after=100) == pytest.approx(0.02)
    assert result.growth("core", after=150) == pytest.approx(102 / 104 - 1)


def test_the_mix_has_each_path_a_request_can_take():
    assert {"chat_stream_disconnect", "completion_disconnect", "bad_request",
            "chat_json_schema", "chat_n2_logprobs"} <= set(REQUEST_KINDS)
