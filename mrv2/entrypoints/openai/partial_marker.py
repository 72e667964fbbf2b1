"""The text a streaming parser holds back: a tail of what it has seen that may be the start of
a marker (``<tool_call>``, ``</think>``, ...) split across chunks.

Parsers work on text, never on the tokenizer's split of a marker into tokens: a marker may arrive
whole, one character at a time, or cut anywhere, and the parsed result must not change.
"""

from __future__ import annotations


def partial_marker_len(text: str, *markers: str) -> int:
    """Length of the longest suffix of `text` that is a proper, non-empty prefix of one of
    `markers` (0 when none): those characters are undecided until more text arrives.

    A complete marker inside `text` is the caller's to find first; this only looks at the end.
    """
    best = 0
    for marker in markers:
        for k in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best
