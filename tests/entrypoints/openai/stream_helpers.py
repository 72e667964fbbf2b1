"""Ways to cut a model output into streamed chunks, for the parsers' stream-equals-whole tests."""

from __future__ import annotations

import random
from collections.abc import Iterator


def chunkings(text: str, seeds: int, max_piece: int, cut_step: int = 1
              ) -> Iterator[list[str]]:
    """Whole, one character at a time, random sizes up to `max_piece` (fixed seeds), and every
    `cut_step`-th cut in two."""
    yield [text]
    yield list(text)
    for seed in range(seeds):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, max_piece)
            pieces.append(text[i:i + n])
            i += n
        yield pieces
    for cut in range(1, len(text), cut_step):
        yield [text[:cut], text[cut:]]
