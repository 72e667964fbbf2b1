"""partial_marker_len: how much of a text's end may still become a marker."""

from __future__ import annotations

import pytest

from mrv2.entrypoints.openai.partial_marker import partial_marker_len


@pytest.mark.parametrize("text, markers, held", [
    ("", ("<think>",), 0),
    ("abc", ("<think>",), 0),
    ("abc<", ("<think>",), 1),
    ("abc<thin", ("<think>",), 5),
    ("abc<think>", ("<think>",), 0),  # complete: the caller's to find, nothing held
    ("a</thi", ("<think>", "</think>"), 5),
    ("a<", ("<think>", "</think>"), 1),
    ("<<th", ("<think>",), 3),
    ("x<tool_call", ("<tool_call>",), 10),
])
def test_partial_marker_len(text, markers, held):
    assert partial_marker_len(text, *markers) == held
