"""CudaGraphManager: dispatch a step to a captured CUDA graph, capture them, replay them.

Step 6 of DESIGN.md section 2. Per step the runner asks `padded_sizes(num_tokens, num_reqs,
uniform_decode)`; with a descriptor it prepares inputs padded to the descriptor's sizes
(invariant 6) and calls `replay(descriptor)`, otherwise it runs the model eagerly on the real
sizes. Which descriptor serves which batch is the pure logic of `dispatch.py`.

Capture contract (`capture(run_fn)`): `run_fn(descriptor)` runs the forward for a batch of
exactly `descriptor.num_tokens` tokens and `descriptor.num_reqs` rows and returns its output.
A graph replays the kernels it recorded on the addresses it recorded, so run_fn must

- read every per-step input from the persistent, fixed-address step buffers (`InputBuffers`:
  input_ids, positions, query_start_loc, seq_lens, block_tables, slot_mapping, sliced to the
  descriptor's sizes) and the KV cache, never from tensors made fresh for one step;
- take every host-side value it uses (shapes, grid sizes, row counts, attention metadata
  scalars such as num_decodes or max_seq_len) from the descriptor and the limits alone, never
  from one batch's contents: the graph freezes them. A mixed ("FULL") graph therefore needs an
  attention backend that finds decode rows, query lengths and seq lens on the device;
- not synchronise with or copy to the host.

The output tensor each graph returns is kept per descriptor and is rewritten in place by every
replay of that graph: read (or copy) what you need before that graph replays again. Each stays
allocated in the pool; to share one block across graphs, have run_fn copy its result into a
persistent [max tokens, ...] buffer and return the `[:num_tokens]` view of it. All graphs
share one memory pool (`torch.cuda.graph_pool_handle()`); they are captured largest first so
smaller graphs reuse the pool's blocks. Graphs never run concurrently, so sharing is safe.

On CPU (or with enforce_eager, or mode "NONE") the config resolves to "NONE": no descriptors,
the dispatcher serves no batch, `padded_sizes` returns the real sizes and `capture` does
nothing.
"""

from __future__ import annotations

from typing import Callable

import torch

from mrv2.config import CompilationConfig
from mrv2.cudagraph.dispatch import BatchDescriptor, CudaGraphDispatcher


class CudaGraphManager:
    def __init__(self, compilation_config: CompilationConfig, max_num_tokens: int,
                 max_num_reqs: int, device: str | torch.device) -> None:
        self.device = torch.device(device)
        # resolve() is idempotent: an already-resolved config (e.g. with enforce_eager
        # applied by EngineArgs) comes back unchanged.
        self.dispatcher = CudaGraphDispatcher(
            compilation_config.resolve(self.device, max_num_tokens, max_num_reqs),
            max_num_tokens, max_num_reqs)
        # Bound once: the per-step call goes straight to the table lookups.
        self.padded_sizes = self.dispatcher.padded_sizes
        self._pool = None
        self._graphs: dict[BatchDescriptor, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[BatchDescriptor, torch.Tensor] = {}

    @property
    def descriptors(self) -> tuple[BatchDescriptor, ...]:
        """Every descriptor to capture, largest first."""
        return self.dispatcher.descriptors

    def capture(self, run_fn: Callable[[BatchDescriptor], torch.Tensor],
                warmup: bool = True) -> None:
        """Capture one graph per descriptor, largest first, into one shared memory pool.

        With `warmup`, run_fn first runs once eagerly per descriptor (lazy initialisation,
        Triton autotuning and compilation must not happen inside a capture). Call it under
        `torch.inference_mode()` with the step buffers holding padding-safe values (slot_mapping
        -1 so that nothing writes the KV cache, block-table rows 0, positions in range).
        """
        if not self.descriptors:
            return
        if self._graphs:
            raise RuntimeError("CUDA graphs are already captured")
        if self.device.type != "cuda":  # unreachable: resolve() gives "NONE" off CUDA
            raise RuntimeError(f"CUDA graph capture on {self.device}")
        self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            for desc in self.descriptors:
                if warmup:
                    run_fn(desc)
                    torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    output = run_fn(desc)
                self._graphs[desc] = graph
                self._outputs[desc] = output
            torch.cuda.synchronize()

    def replay(self, descriptor: BatchDescriptor) -> torch.Tensor:
        """Replay the graph for `descriptor` on the current stream; returns its padded output
        (slicing it to the real batch is the caller's job)."""
        graph = self._graphs.get(descriptor)
        if graph is None:
            raise KeyError(f"no captured CUDA graph for {descriptor}")
        graph.replay()
        return self._outputs[descriptor]
