"""Batch descriptors and the dispatch table: which captured graph serves a batch, if any.

Pure host logic, no device: the same table runs on CPU (where the manager resolves to mode
"NONE" and the table is empty) and in tests that build it with any mode.

A descriptor is the shape a graph was captured with. A real batch (num_tokens, num_reqs,
uniform_decode) is served by the smallest descriptor that fits, after padding up to it:

- Uniform decode (every row has one query token, so num_tokens == num_reqs), modes
  "FULL_DECODE_ONLY" and "FULL": `BatchDescriptor(s, s, True)` for the smallest capture size
  s >= num_tokens with s <= max_num_reqs. Both counts are padded to s.
- Any other batch, mode "FULL" only (and a uniform-decode batch too large for a decode graph):
  `BatchDescriptor(s, min(s, max_num_reqs), False)` for the smallest capture size
  s >= num_tokens. Tokens are padded to s; rows are padded to min(s, max_num_reqs), an upper
  bound on the rows of any batch of at most s tokens (each row has at least one token), so one
  graph per size serves every mix of decodes and prefill chunks.

Padded rows and tokens follow DESIGN.md invariant 6 (query_start_loc = num_tokens, seq_lens = 0,
block-table rows = 0, slot_mapping = -1): padded rows have no query tokens and no keys, padded
tokens belong to no row and never write the KV cache. `prepare_inputs` does that padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrv2.config import CompilationConfig


@dataclass(frozen=True)
class BatchDescriptor:
    """The static shape of one captured graph: the padded batch it runs."""

    num_tokens: int
    num_reqs: int
    uniform_decode: bool


class CudaGraphDispatcher:
    """Descriptors for a mode and capture sizes, plus O(1) lookup tables indexed by num_tokens.

    Sizes are fitted to the limits here as well (decode graphs to max_num_reqs, every graph to
    max_num_tokens), so an unresolved config gives the same descriptors as a resolved one. The
    device is not consulted: `CudaGraphManager` resolves the config against it first.
    """

    def __init__(self, compilation_config: CompilationConfig, max_num_tokens: int,
                 max_num_reqs: int) -> None:
        if max_num_tokens < 1 or max_num_reqs < 1:
            raise ValueError(f"max_num_tokens={max_num_tokens} and max_num_reqs={max_num_reqs} "
                             f"must be positive")
        self.mode = compilation_config.cudagraph_mode
        sizes = compilation_config.capture_sizes if self.mode != "NONE" else ()
        decode_sizes = [s for s in sizes if s <= min(max_num_tokens, max_num_reqs)]
        mixed_sizes = [s for s in sizes if s <= max_num_tokens] if self.mode == "FULL" else []
        decode = [BatchDescriptor(s, s, True) for s in decode_sizes]
        mixed = [BatchDescriptor(s, min(s, max_num_reqs), False) for s in mixed_sizes]
        # _decode_table[n] / _mixed_table[n]: smallest descriptor with num_tokens >= n.
        self._decode_table = _smallest_fit_table(decode)
        self._mixed_table = _smallest_fit_table(mixed)
        # Capture order: largest first, so that smaller graphs reuse the shared memory pool.
        self.descriptors: tuple[BatchDescriptor, ...] = tuple(sorted(
            decode + mixed, key=lambda d: (d.num_tokens, d.num_reqs, not d.uniform_decode),
            reverse=True))

    def dispatch(self, num_tokens: int, num_reqs: int,
                 uniform_decode: bool) -> BatchDescriptor | None:
        """The smallest captured descriptor that fits this batch, or None (run eagerly)."""
        if uniform_decode and num_tokens != num_reqs:
            raise ValueError(f"a uniform-decode batch has one token per row, got "
                             f"num_tokens={num_tokens}, num_reqs={num_reqs}")
        if num_reqs > num_tokens:
            raise ValueError(f"num_reqs={num_reqs} > num_tokens={num_tokens}: every scheduled "
                             f"row has at least one token")
        if num_tokens < 1:
            return None
        if uniform_decode and num_tokens < len(self._decode_table):
            desc = self._decode_table[num_tokens]
            if desc is not None:
                return desc
        if num_tokens < len(self._mixed_table):
            desc = self._mixed_table[num_tokens]
            if desc is not None and num_reqs <= desc.num_reqs:
                return desc
        return None

    def padded_sizes(self, num_tokens: int, num_reqs: int,
                     uniform_decode: bool) -> tuple[int, int, BatchDescriptor | None]:
        """(num_tokens_padded, num_reqs_padded, descriptor); the real sizes when eager."""
        desc = self.dispatch(num_tokens, num_reqs, uniform_decode)
        if desc is None:
            return num_tokens, num_reqs, None
        return desc.num_tokens, desc.num_reqs, desc


def _smallest_fit_table(descs: list[BatchDescriptor]) -> list[BatchDescriptor | None]:
    """table[n] = the descriptor with the smallest num_tokens >= n (index 0 is None)."""
    if not descs:
        return []
    by_size = sorted(descs, key=lambda d: d.num_tokens)
    table: list[BatchDescriptor | None] = [None] * (by_size[-1].num_tokens + 1)
    lo = 1
    for desc in by_size:
        table[lo:desc.num_tokens + 1] = [desc] * (desc.num_tokens + 1 - lo)
        lo = desc.num_tokens + 1
    return table
