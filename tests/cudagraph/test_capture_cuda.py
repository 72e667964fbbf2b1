"""Graph capture and replay on a GPU: replay of a padded batch equals eager execution.

A tiny "model" reads only from fixed-address step buffers (input_ids, positions, slot_mapping)
and writes a KV-cache-like tensor the way a backend must under a graph: slot -1 (padding) goes
to a spare row instead of being filtered out on the host.
"""

from __future__ import annotations

import pytest
import torch

from mrv2.config import CompilationConfig
from mrv2.cudagraph import BatchDescriptor, CudaGraphManager

pytestmark = pytest.mark.cuda

MAX_TOKENS, MAX_REQS, HIDDEN, VOCAB, NUM_SLOTS = 32, 8, 16, 50, 64
SIZES = (1, 2, 4, 8, 16, 32)


class _TinyStep:
    def __init__(self, seed: int = 0) -> None:
        dev = torch.device("cuda")
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((MAX_TOKENS,), -1, dtype=torch.int64, device=dev)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(dev)
        self.weight = torch.randn(HIDDEN, HIDDEN, generator=gen).to(dev) / HIDDEN ** 0.5
        # Row NUM_SLOTS is the sink for padded tokens (slot -1).
        self.cache = torch.zeros(NUM_SLOTS + 1, HIDDEN, device=dev)
        self.calls: list[BatchDescriptor] = []

    def forward(self, num_tokens: int) -> torch.Tensor:
        ids = self.input_ids[:num_tokens]
        x = self.embed[ids] + 0.01 * self.positions[:num_tokens, None].float()
        h = torch.tanh(x @ self.weight)
        slots = self.slot_mapping[:num_tokens]
        self.cache.index_copy_(0, torch.where(slots >= 0, slots, NUM_SLOTS), h)
        return h * 2.0

    def run_fn(self, desc: BatchDescriptor) -> torch.Tensor:
        self.calls.append(desc)
        return self.forward(desc.num_tokens)

    def fill(self, num_tokens: int, num_tokens_padded: int, gen: torch.Generator) -> None:
        """Write a real batch into the buffers and pad its tail (invariant 6 for slots)."""
        self.input_ids[:num_tokens] = torch.randint(0, VOCAB, (num_tokens,), generator=gen)
        self.positions[:num_tokens] = torch.randint(0, 100, (num_tokens,), generator=gen)
        real_slots = torch.randperm(NUM_SLOTS, generator=gen)[:num_tokens]
        self.slot_mapping[:num_tokens] = real_slots
        self.slot_mapping[num_tokens:num_tokens_padded] = -1
        # Stale values in the padded tail of the other buffers are harmless.
        self.input_ids[num_tokens:num_tokens_padded] = VOCAB - 1
        self.positions[num_tokens:num_tokens_padded] = 7


def _replay_vs_eager(manager: CudaGraphManager, step: _TinyStep, num_tokens: int, num_reqs: int,
                     uniform: bool, gen: torch.Generator) -> BatchDescriptor:
    num_tokens_p, num_reqs_p, desc = manager.padded_sizes(num_tokens, num_reqs, uniform)
    assert desc is not None and num_tokens_p >= num_tokens and num_reqs_p >= num_reqs
    step.fill(num_tokens, num_tokens_p, gen)
    step.cache.normal_(generator=None)
    cache_before = step.cache.clone()
    eager = step.forward(num_tokens).clone()
    eager_cache = step.cache[:NUM_SLOTS].clone()

    step.cache.copy_(cache_before)
    out = manager.replay(desc)
    assert out.shape == (num_tokens_p, HIDDEN)
    torch.testing.assert_close(out[:num_tokens], eager, rtol=1e-4, atol=1e-4)
    # Same KV writes: the real slots got the same values, padded tokens touched no real slot.
    torch.testing.assert_close(step.cache[:NUM_SLOTS], eager_cache, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool, device="cuda")
    untouched[step.slot_mapping[:num_tokens]] = False
    assert torch.equal(step.cache[:NUM_SLOTS][untouched], cache_before[:NUM_SLOTS][untouched])
    return desc


def test_full_replay_equals_eager() -> None:
    gen = torch.Generator().manual_seed(1)
    step = _TinyStep()
    manager = CudaGraphManager(CompilationConfig("FULL", SIZES), MAX_TOKENS, MAX_REQS, "cuda")
    assert manager.dispatcher.mode == "FULL"
    with torch.inference_mode():
        manager.capture(step.run_fn)
        # Warm-up then capture per descriptor, largest first.
        assert step.calls == [d for d in manager.descriptors for _ in range(2)]
        assert step.calls[0] == BatchDescriptor(32, 8, False)
        seen = set()
        for num_tokens, num_reqs, uniform in [(1, 1, True), (3, 3, True), (8, 8, True),
                                              (1, 1, False), (5, 2, False), (13, 4, False),
                                              (17, 8, False), (32, 8, False), (3, 3, True)]:
            seen.add(_replay_vs_eager(manager, step, num_tokens, num_reqs, uniform, gen))
        assert BatchDescriptor(4, 4, True) in seen and BatchDescriptor(16, 8, False) in seen


def test_replay_output_has_a_fixed_address_and_follows_the_buffers() -> None:
    gen = torch.Generator().manual_seed(2)
    step = _TinyStep()
    manager = CudaGraphManager(CompilationConfig("FULL_DECODE_ONLY", SIZES), MAX_TOKENS,
                               MAX_REQS, "cuda")
    with torch.inference_mode():
        manager.capture(step.run_fn)
        assert [d.num_tokens for d in manager.descriptors] == [8, 4, 2, 1]
        desc = _replay_vs_eager(manager, step, 6, 6, True, gen)
        first = manager.replay(desc)
        ptr, before = first.data_ptr(), first.clone()
        _replay_vs_eager(manager, step, 6, 6, True, gen)  # new inputs in the same buffers
        again = manager.replay(desc)
        assert again.data_ptr() == ptr and not torch.equal(again, before)
        # Mixed batches are not captured in this mode.
        assert manager.padded_sizes(6, 3, False) == (6, 3, None)


def test_capture_without_warmup() -> None:
    dev = torch.device("cuda")
    x = torch.zeros(MAX_TOKENS, device=dev)
    manager = CudaGraphManager(CompilationConfig("FULL", (4, 8)), 8, 8, dev)
    with torch.inference_mode():
        manager.capture(lambda d: x[:d.num_tokens] * 2 + 1, warmup=False)
        for n in (3, 8):
            _, _, desc = manager.padded_sizes(n, 1, False)
            x.copy_(torch.arange(MAX_TOKENS, device=dev, dtype=torch.float32) * n)
            out = manager.replay(desc)
            torch.testing.assert_close(out[:n], x[:n] * 2 + 1)
