"""CompilationConfig, the dispatch table and the manager's capture/replay bookkeeping, on CPU."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from mrv2.config import CompilationConfig, ConfigError
from mrv2.cudagraph import BatchDescriptor, CudaGraphDispatcher, CudaGraphManager

from cudagraph_helpers import captured, max_capture_size

DEFAULT_SIZES = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))


# ---- CompilationConfig ---------------------------------------------------------------------

def test_default_capture_sizes() -> None:
    config = CompilationConfig()
    assert config.cudagraph_mode == "FULL_DECODE_ONLY"  # resolved to "NONE" off CUDA
    assert config.cudagraph_capture_sizes is None
    assert config.max_cudagraph_capture_size == 512
    assert config.capture_sizes == DEFAULT_SIZES
    assert len(DEFAULT_SIZES) == 51 and DEFAULT_SIZES[:6] == (1, 2, 4, 8, 16, 24)
    assert DEFAULT_SIZES[34:37] == (256, 272, 288)


@pytest.mark.parametrize("max_size, expected_tail", [
    (1, (1,)), (3, (1, 2)), (7, (1, 2, 4)), (100, (88, 96)), (256, (248, 256)),
    (300, (256, 272, 288)), (1024, (992, 1008, 1024)),
])
def test_default_sizes_follow_max(max_size: int, expected_tail: tuple[int, ...]) -> None:
    sizes = CompilationConfig(max_cudagraph_capture_size=max_size).capture_sizes
    assert sizes[-len(expected_tail):] == expected_tail
    assert list(sizes) == sorted(set(sizes)) and max(sizes) <= max_size
    assert all(s in (1, 2, 4) or (s % 8 == 0 and s <= 256) or s % 16 == 0 for s in sizes)


def test_explicit_sizes_sorted_deduplicated_tuple() -> None:
    config = CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=[8, 1, 8, 4])
    assert config.cudagraph_capture_sizes == (1, 4, 8)
    assert config.capture_sizes == (1, 4, 8)
    assert config == CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=(4, 8, 1))
    assert hash(config) == hash(CompilationConfig("FULL", (1, 4, 8)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cudagraph_mode = "NONE"  # type: ignore[misc]


@pytest.mark.parametrize("kwargs", [
    dict(cudagraph_mode="PIECEWISE"),
    dict(cudagraph_mode="full"),
    dict(cudagraph_mode=None),
    dict(cudagraph_capture_sizes=(0, 8)),
    dict(cudagraph_capture_sizes=(-4,)),
    dict(cudagraph_capture_sizes=(2.0,)),
    dict(cudagraph_capture_sizes=(True,)),
    dict(cudagraph_capture_sizes="8"),
    dict(cudagraph_capture_sizes=8),
    dict(max_cudagraph_capture_size=0),
    dict(max_cudagraph_capture_size=-1),
    dict(max_cudagraph_capture_size=8.0),
    dict(cudagraph_capture_sizes=(8, 1024)),  # above max_cudagraph_capture_size=512
])
def test_validation(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        CompilationConfig(**kwargs)


def test_empty_explicit_sizes_mean_no_graphs() -> None:
    config = CompilationConfig(cudagraph_mode="FULL", cudagraph_capture_sizes=())
    assert config.capture_sizes == ()
    assert config.resolve("cuda", 2048, 256).cudagraph_mode == "NONE"


@pytest.mark.parametrize("mode", CompilationConfig.MODES)
def test_resolve_on_cpu_is_none(mode: str) -> None:
    for device in ("cpu", torch.device("cpu")):
        resolved = CompilationConfig(cudagraph_mode=mode).resolve(device, 2048, 256)
        assert resolved.cudagraph_mode == "NONE" and resolved.capture_sizes == ()


@pytest.mark.parametrize("mode", CompilationConfig.MODES)
def test_resolve_enforce_eager_is_none(mode: str) -> None:
    resolved = CompilationConfig(cudagraph_mode=mode).resolve("cuda", 2048, 256,
                                                              enforce_eager=True)
    assert resolved.cudagraph_mode == "NONE" and resolved.capture_sizes == ()


def test_resolve_on_cuda_clips_sizes() -> None:
    full = CompilationConfig(cudagraph_mode="FULL").resolve("cuda", 100, 16)
    assert full.cudagraph_mode == "FULL"
    assert full.capture_sizes == tuple(s for s in DEFAULT_SIZES if s <= 100)
    assert full.capture_sizes[-1] == 96
    decode = CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY").resolve("cuda:0", 100, 16)
    assert decode.cudagraph_mode == "FULL_DECODE_ONLY"
    assert decode.capture_sizes == (1, 2, 4, 8, 16)
    # max_num_batched_tokens below max_num_seqs bounds decode graphs too.
    assert CompilationConfig("FULL_DECODE_ONLY").resolve("cuda", 6, 16).capture_sizes == (1, 2, 4)
    # Nothing left to capture: eager.
    nothing = CompilationConfig("FULL", (64, 128)).resolve("cuda", 32, 8)
    assert nothing.cudagraph_mode == "NONE" and nothing.capture_sizes == ()
    unchanged = CompilationConfig("FULL", (64, 128), max_cudagraph_capture_size=128)
    assert unchanged.resolve("cuda", 4096, 256) == unchanged


@pytest.mark.parametrize("mode", CompilationConfig.MODES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_resolve_is_idempotent(mode: str, device: str) -> None:
    once = CompilationConfig(cudagraph_mode=mode).resolve(device, 300, 40)
    assert once.resolve(device, 300, 40) == once


# ---- dispatch table ------------------------------------------------------------------------

def _reference(mode: str, sizes: tuple[int, ...], max_tokens: int, max_reqs: int,
               num_tokens: int, num_reqs: int, uniform: bool) -> BatchDescriptor | None:
    """Brute force over the capture sizes, straight from the rule in dispatch.py."""
    if uniform and mode in ("FULL_DECODE_ONLY", "FULL"):
        fits = [s for s in sizes if num_tokens <= s <= min(max_tokens, max_reqs)]
        if fits:
            return BatchDescriptor(min(fits), min(fits), True)
    if mode == "FULL":
        fits = [s for s in sizes if num_tokens <= s <= max_tokens]
        if fits and num_reqs <= min(min(fits), max_reqs):
            return BatchDescriptor(min(fits), min(min(fits), max_reqs), False)
    return None


@pytest.mark.parametrize("mode", CompilationConfig.MODES)
@pytest.mark.parametrize("sizes, max_tokens, max_reqs", [
    (None, 300, 40),  # default sizes, both limits inside them
    (None, 600, 600),  # limits above every size
    ((3, 5, 17, 64), 64, 64),
    ((1, 2, 4, 8, 16), 12, 3),  # max_reqs below most sizes, max_tokens between sizes
])
def test_dispatch_table_every_num_tokens(mode: str, sizes, max_tokens: int,
                                         max_reqs: int) -> None:
    config = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=sizes)
    table = CudaGraphDispatcher(config, max_tokens, max_reqs)
    captured = set(table.descriptors)
    for num_tokens in range(1, max_tokens + 1):
        row_counts = {1, min(num_tokens, max_reqs), max(1, min(num_tokens, max_reqs) // 2)}
        cases = [(n, False) for n in row_counts]
        if num_tokens <= max_reqs:
            cases.append((num_tokens, True))
        for num_reqs, uniform in cases:
            expected = _reference(mode, config.capture_sizes, max_tokens, max_reqs, num_tokens,
                                  num_reqs, uniform)
            desc = table.dispatch(num_tokens, num_reqs, uniform)
            assert desc == expected, (num_tokens, num_reqs, uniform)
            padded = table.padded_sizes(num_tokens, num_reqs, uniform)
            if desc is None:
                assert padded == (num_tokens, num_reqs, None)
                continue
            assert desc in captured
            assert padded == (desc.num_tokens, desc.num_reqs, desc)
            assert desc.num_tokens >= num_tokens and desc.num_reqs >= num_reqs
            assert desc.num_reqs <= max_reqs and desc.num_tokens <= max_tokens
            # Smallest fit: no captured descriptor of the same kind lies in between.
            assert not any(d.uniform_decode == desc.uniform_decode
                           and num_tokens <= d.num_tokens < desc.num_tokens for d in captured)


def test_full_decode_only() -> None:
    table = CudaGraphDispatcher(CompilationConfig("FULL_DECODE_ONLY"), 2048, 64)
    assert all(d.uniform_decode and d.num_tokens == d.num_reqs for d in table.descriptors)
    assert [d.num_tokens for d in table.descriptors] == [64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1]
    assert table.padded_sizes(3, 3, True) == (4, 4, BatchDescriptor(4, 4, True))
    assert table.padded_sizes(33, 33, True) == (40, 40, BatchDescriptor(40, 40, True))
    # Mixed batches, even tiny ones, run eagerly.
    assert table.padded_sizes(3, 2, False) == (3, 2, None)
    assert table.padded_sizes(1, 1, False) == (1, 1, None)


def test_full_mixed_rows_pad_to_min_of_size_and_max_reqs() -> None:
    table = CudaGraphDispatcher(CompilationConfig("FULL"), 2048, 64)
    assert table.padded_sizes(5, 2, False) == (8, 8, BatchDescriptor(8, 8, False))
    assert table.padded_sizes(100, 3, False) == (104, 64, BatchDescriptor(104, 64, False))
    assert table.padded_sizes(512, 64, False) == (512, 64, BatchDescriptor(512, 64, False))
    assert table.padded_sizes(513, 1, False) == (513, 1, None)  # above the largest graph
    # A uniform-decode batch prefers its decode graph (decode graphs stop at max_num_reqs).
    assert table.padded_sizes(5, 5, True) == (8, 8, BatchDescriptor(8, 8, True))
    assert table.dispatch(64, 64, True) == BatchDescriptor(64, 64, True)
    assert table.dispatch(63, 62, False) == BatchDescriptor(64, 64, False)
    # A uniform batch that no decode graph covers falls back to a mixed graph.
    small = CudaGraphDispatcher(CompilationConfig("FULL", (4, 16)), 16, 16)
    assert small.dispatch(3, 3, True) == BatchDescriptor(4, 4, True)
    capped = CudaGraphDispatcher(CompilationConfig("FULL", (4, 16)), 16, 8)
    assert capped.dispatch(8, 8, True) == BatchDescriptor(16, 8, False)
    assert [*capped.descriptors] == [BatchDescriptor(16, 8, False), BatchDescriptor(4, 4, False),
                                     BatchDescriptor(4, 4, True)]


def test_none_mode_never_dispatches() -> None:
    table = CudaGraphDispatcher(CompilationConfig("NONE", (1, 2, 4)), 16, 16)
    assert table.descriptors == () and max_capture_size(table) == 0
    for n in range(1, 17):
        assert table.padded_sizes(n, n, True) == (n, n, None)
        assert table.padded_sizes(n, 1, False) == (n, 1, None)


def test_dispatch_rejects_impossible_batches() -> None:
    table = CudaGraphDispatcher(CompilationConfig("FULL"), 64, 16)
    with pytest.raises(ValueError, match="uniform-decode"):
        table.dispatch(4, 3, True)
    with pytest.raises(ValueError, match="at least one token"):
        table.dispatch(3, 4, False)
    assert table.dispatch(0, 0, False) is None  # no tokens: nothing to run
    with pytest.raises(ValueError):
        CudaGraphDispatcher(CompilationConfig("FULL"), 0, 16)


def test_capture_order_is_largest_first() -> None:
    table = CudaGraphDispatcher(CompilationConfig("FULL"), 300, 40)
    sizes = [d.num_tokens for d in table.descriptors]
    assert sizes == sorted(sizes, reverse=True)
    assert max_capture_size(table) == sizes[0] == 288
    assert len(set(table.descriptors)) == len(table.descriptors)
    assert sum(d.uniform_decode for d in table.descriptors) == 8  # 1 2 4 8 16 24 32 40


def test_batch_descriptor_frozen_hashable() -> None:
    desc = BatchDescriptor(8, 8, True)
    assert desc == BatchDescriptor(8, 8, True) != BatchDescriptor(8, 8, False)
    assert {desc: 1}[BatchDescriptor(8, 8, True)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        desc.num_tokens = 16  # type: ignore[misc]


# ---- manager -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", CompilationConfig.MODES)
def test_manager_on_cpu_runs_eagerly(mode: str) -> None:
    manager = CudaGraphManager(CompilationConfig(cudagraph_mode=mode), 2048, 256, "cpu")
    assert manager.dispatcher.mode == "NONE" and manager.descriptors == ()
    for n in (1, 3, 8, 512):
        assert manager.dispatcher.dispatch(n, n, True) is None
        assert manager.padded_sizes(n, 1, False) == (n, 1, None)

    def run_fn(desc: BatchDescriptor) -> torch.Tensor:
        raise AssertionError("capture must not run anything on CPU")

    manager.capture(run_fn)
    assert not captured(manager)
    with pytest.raises(KeyError):
        manager.replay(BatchDescriptor(1, 1, True))


class _FakeGraph:
    replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_manager_capture_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture loop without a GPU: torch.cuda's graph API replaced by recorders."""
    events: list[tuple] = []
    pool = object()
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, **kwargs):
        events.append(("begin", pool))
        yield
        events.append(("end", pool))

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    manager = CudaGraphManager(CompilationConfig("FULL", (1, 2, 4, 8)), 8, 4, "cuda")
    assert manager.dispatcher.mode == "FULL"
    expected = [BatchDescriptor(8, 4, False), BatchDescriptor(4, 4, False),
                BatchDescriptor(4, 4, True), BatchDescriptor(2, 2, False),
                BatchDescriptor(2, 2, True), BatchDescriptor(1, 1, False),
                BatchDescriptor(1, 1, True)]
    assert list(manager.descriptors) == expected
    outputs = {}

    def run_fn(desc: BatchDescriptor) -> torch.Tensor:
        events.append(("run", desc))
        outputs[desc] = torch.full((desc.num_tokens,), float(desc.num_tokens))
        return outputs[desc]

    manager.capture(run_fn)
    # Per descriptor, largest first: one warm-up run outside the graph, then the captured run,
    # every capture into the same pool.
    want = []
    for desc in expected:
        want += [("run", desc), ("begin", pool), ("run", desc), ("end", pool)]
    assert events == want
    assert captured(manager)
    for desc in expected:
        out = manager.replay(desc)
        assert out is outputs[desc]  # the output captured for it, not a copy
    with pytest.raises(RuntimeError, match="already captured"):
        manager.capture(run_fn)

    events.clear()
    no_warmup = CudaGraphManager(CompilationConfig("FULL_DECODE_ONLY", (2, 4)), 8, 4, "cuda")
    no_warmup.capture(run_fn, warmup=False)
    assert events == [("begin", pool), ("run", BatchDescriptor(4, 4, True)), ("end", pool),
                      ("begin", pool), ("run", BatchDescriptor(2, 2, True)), ("end", pool)]
