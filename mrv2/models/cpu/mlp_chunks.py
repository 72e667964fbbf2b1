"""The Llama-family MLP over a long CPU batch, in chunks of rows.

Why: a prefill's [T, 2I] gate/up intermediate is far larger than the CPU caches and costs page
faults and DRAM round trips; chunks of rows keep it in the last-level cache (bench/README.md
has the measurement).
"""

from __future__ import annotations

from typing import Callable

import torch

# The size of one chunk's [rows, 2I] float32 intermediate (a fraction of the last-level cache).
CHUNK_BYTES = 8 << 20


def chunk_rows(mlp) -> int:
    """Rows per chunk: the gate/up intermediate stays within CHUNK_BYTES."""
    return max(128, CHUNK_BYTES // (8 * mlp.intermediate_size))


class ChunkedMLP:
    """`forward` of one LlamaMLP: batches of more than `chunk_rows` rows on the CPU run
    `forward` (the MLP's own unless another is given) chunk by chunk, others run it once."""

    def __init__(self, mlp, forward: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> None:
        self.mlp = mlp
        self.forward = forward or own_forward(mlp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = chunk_rows(self.mlp)
        if x.device.type == "cpu" and x.shape[0] > rows:
            out = x.new_empty(x.shape[0], x.shape[1])
            for start in range(0, x.shape[0], rows):
                out[start:start + rows] = self.forward(x[start:start + rows])
            return out
        return self.forward(x)


def own_forward(mlp) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's own forward, bound (whatever `mlp.forward` was set to since)."""
    return type(mlp).forward.__get__(mlp)


def attach_chunked_mlp(mlp, forward: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> ChunkedMLP:
    """Run `mlp` (a LlamaMLP) in row chunks on long CPU batches, each through `forward` (the
    module's own by default)."""
    chunked = mlp.forward = ChunkedMLP(mlp, forward)
    return chunked
