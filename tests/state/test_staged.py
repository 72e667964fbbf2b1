"""StagedWriteTensor: ragged host-side runs written to a persistent tensor with one kernel launch
(DESIGN.md invariants 3 and 5), on both implementations: the numba CPU kernel and the Triton
kernel, which runs here under TRITON_INTERPRET=1 on CPU tensors. Also HostStaging, the
double-buffered upload the Triton path packs its runs into.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
# Imported here, outside the interpreter, as a full test run does (other tests use compiled
# Triton): Triton's own jitted helpers (tl.zeros, tl.cdiv, ...) then fail under the
# interpreter, so the kernels must not use them.
import triton.language  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from mrv2 import platform as dispatch
from mrv2.state import staged_numba
from mrv2.state.host_staging import HostStaging, upload_array
from mrv2.state.staged import StagedWriteTensor, last_write_per_element, runs_overlap

from staged_helpers import num_staged

IMPLS = ["cpu", "triton"]


@pytest.fixture(params=IMPLS)
def impl(request):
    """The test runs with the numba kernels, then with the Triton ones (interpreted)."""
    with dispatch.kernels_on_cpu(request.param):
        yield request.param


class OpLog(TorchDispatchMode):
    """Records every aten op that runs inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_launches(monkeypatch, impl: str):
    """Counts calls of the apply kernel of `impl`: yields the run count of each call."""
    calls: list[int] = []
    if impl == "cpu":
        original = staged_numba.apply_runs

        def wrapper(dst, starts, lengths, values):
            calls.append(len(starts))
            return original(dst, starts, lengths, values)

        monkeypatch.setattr(staged_numba, "apply_runs", wrapper)
    else:
        from mrv2.state import staged_triton

        original = staged_triton.apply_runs

        def wrapper(dst, meta, values, num_runs):
            calls.append(num_runs)
            return original(dst, meta, values, num_runs)

        monkeypatch.setattr(staged_triton, "apply_runs", wrapper)
    yield calls


def test_ragged_runs_on_2d_tensor_applied_with_one_launch(impl, monkeypatch) -> None:
    staged = StagedWriteTensor(torch.zeros(4, 5, dtype=torch.int32))
    staged.stage_write(0, 1, [1, 2])
    staged.stage_write(3, 0, [3, 4, 5, 6, 7])
    staged.stage_write(2, 4, [8])
    staged.stage_write(1, 2, [9, 10, 11])
    assert num_staged(staged) == 4
    with count_launches(monkeypatch, impl) as launches, OpLog() as log:
        staged.apply()
    # One kernel launch for all runs, no per-row torch ops.
    assert launches == [4]
    assert not {"aten.index_put_", "aten.index_copy_", "aten.select"} & set(log.ops)
    if impl == "cpu":
        assert log.ops == []  # the numba kernel writes the tensor's memory directly
    assert staged.tensor.tolist() == [
        [0, 1, 2, 0, 0],
        [0, 0, 9, 10, 11],
        [0, 0, 0, 0, 8],
        [3, 4, 5, 6, 7],
    ]


def test_1d_tensor_stage_set_and_write(impl, monkeypatch) -> None:
    staged = StagedWriteTensor(torch.zeros(6, dtype=torch.float32))
    staged.stage_set(1, 0.5)
    staged.stage_set(4, -2.25)
    staged.stage_write(5, 0, [7.0])
    with count_launches(monkeypatch, impl) as launches:
        staged.apply()
    assert launches == [3]
    assert staged.tensor.tolist() == [0.0, 0.5, 0.0, 0.0, -2.25, 7.0]


def test_stage_set_on_2d_sets_column_zero(impl) -> None:
    staged = StagedWriteTensor(torch.full((2, 3), -1, dtype=torch.int64))
    staged.stage_set(1, 42)
    staged.apply()
    assert staged.tensor.tolist() == [[-1, -1, -1], [42, -1, -1]]


def test_int64_values_beyond_int32_survive(impl) -> None:
    staged = StagedWriteTensor(torch.zeros(2, dtype=torch.int64))
    staged.stage_set(0, 2**62 + 3)
    staged.apply()
    assert staged.tensor[0].item() == 2**62 + 3


def test_later_write_to_same_element_wins(impl) -> None:
    staged = StagedWriteTensor(torch.zeros(3, 4, dtype=torch.int32))
    staged.stage_write(0, 0, [1, 2, 3, 4])
    staged.stage_write(0, 1, [9])  # overwrites column 1 only
    staged.stage_write(2, 0, [5, 6])
    staged.stage_write(2, 1, [7, 8, 9])  # overlaps column 1 of the previous run
    staged.stage_write(0, 3, [11])
    staged.apply()
    assert staged.tensor.tolist() == [[1, 9, 3, 11], [0, 0, 0, 0], [5, 7, 8, 9]]


def test_later_write_wins_on_1d(impl) -> None:
    staged = StagedWriteTensor(torch.zeros(3, dtype=torch.int32))
    for value in (4, 5, 6):
        staged.stage_set(1, value)
    staged.stage_set(0, 1)
    staged.apply()
    assert staged.tensor.tolist() == [1, 6, 0]


def test_overflow_raises_index_error_and_stages_nothing() -> None:
    staged = StagedWriteTensor(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(IndexError):
        staged.stage_write(0, 2, [1, 2, 3])
    with pytest.raises(IndexError):
        staged.stage_write(1, 0, [1, 2, 3, 4, 5])
    with pytest.raises(IndexError):
        staged.stage_write(0, -1, [1])
    flat = StagedWriteTensor(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(IndexError):
        flat.stage_write(0, 0, [1, 2])  # a 1-D row holds one value
    with pytest.raises(IndexError):
        flat.stage_write(0, 1, [1])
    assert num_staged(staged) == 0 and num_staged(flat) == 0
    # Exactly filling a row is fine.
    staged.stage_write(1, 1, [7, 8, 9])
    staged.apply()
    assert staged.tensor.tolist() == [[0, 0, 0, 0], [0, 7, 8, 9]]


def test_empty_run_is_not_staged() -> None:
    staged = StagedWriteTensor(torch.zeros(2, 4, dtype=torch.int32))
    staged.stage_write(1, 0, [])
    staged.stage_write(1, 4, [])  # zero values at the row's end is not an overflow
    assert num_staged(staged) == 0


def test_apply_clears_staged_runs(impl) -> None:
    staged = StagedWriteTensor(torch.zeros(2, 3, dtype=torch.int32))
    staged.stage_write(0, 0, [1, 2, 3])
    staged.apply()
    assert num_staged(staged) == 0
    staged.tensor.zero_()
    staged.apply()  # must not write the old run again
    assert staged.tensor.tolist() == [[0, 0, 0], [0, 0, 0]]
    staged.stage_write(1, 1, [5])
    staged.apply()
    assert staged.tensor.tolist() == [[0, 0, 0], [0, 5, 0]]


def test_apply_with_nothing_staged_is_a_noop() -> None:
    staged = StagedWriteTensor(torch.arange(6, dtype=torch.int32).view(2, 3))
    with OpLog() as log:
        staged.apply()
    assert log.ops == []
    assert staged.tensor.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_tensor_keeps_its_address(impl) -> None:
    tensor = torch.zeros(3, 3, dtype=torch.int32)
    staged = StagedWriteTensor(tensor)
    staged.stage_write(2, 0, [1, 2, 3])
    staged.apply()
    assert staged.tensor is tensor
    assert tensor[2].tolist() == [1, 2, 3]


@pytest.mark.parametrize("shape", [(), (2, 2, 2)])
def test_rejects_other_ranks(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        StagedWriteTensor(torch.zeros(shape))


def test_stage_runs_equals_stage_write_per_run(impl) -> None:
    one_by_one = StagedWriteTensor(torch.zeros(3, 4, dtype=torch.int32))
    batched = StagedWriteTensor(torch.zeros(3, 4, dtype=torch.int32))
    runs = [(2, 1, [1, 2, 3]), (0, 0, []), (0, 3, [4]), (2, 0, [5, 6])]  # empty + overlap
    for row, start, values in runs:
        one_by_one.stage_write(row, start, values)
    batched.stage_set(1, 9)  # mixes with single writes
    one_by_one.stage_set(1, 9)
    batched.stage_runs(np.array([r for r, _, _ in runs]), np.array([s for _, s, _ in runs]),
                       np.array([len(v) for _, _, v in runs]),
                       np.array([x for _, _, v in runs for x in v]))
    assert num_staged(batched) == num_staged(one_by_one) == 4  # the empty run is dropped
    one_by_one.apply()
    batched.apply()
    assert batched.tensor.tolist() == one_by_one.tensor.tolist() == [
        [0, 0, 0, 4], [9, 0, 0, 0], [5, 6, 2, 3]]


def test_stage_runs_rejects_bad_runs_and_stages_nothing() -> None:
    staged = StagedWriteTensor(torch.zeros(2, 4, dtype=torch.int32))
    one = np.array([1])
    with pytest.raises(IndexError):
        staged.stage_runs(np.array([2]), np.array([0]), one, one)  # row out of range
    with pytest.raises(IndexError):
        staged.stage_runs(np.array([0]), np.array([3]), np.array([2]), np.array([1, 2]))
    with pytest.raises(IndexError):
        staged.stage_runs(np.array([0]), np.array([-1]), one, one)
    with pytest.raises(ValueError):
        staged.stage_runs(np.array([0, 1]), np.array([0]), one, one)  # ragged arguments
    with pytest.raises(ValueError):
        staged.stage_runs(np.array([0]), np.array([0]), np.array([2]), one)  # too few values
    assert num_staged(staged) == 0
    staged.stage_runs(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0))
    assert num_staged(staged) == 0


def test_staging_grows_past_its_initial_capacity(impl) -> None:
    staged = StagedWriteTensor(torch.zeros(300, 3, dtype=torch.int64))
    for row in range(300):
        staged.stage_write(row, 0, [row, row + 1, row + 2])
    staged.stage_runs(np.arange(300), np.full(300, 2), np.ones(300, dtype=np.int64),
                      -np.arange(300))
    staged.apply()
    expected = torch.arange(300)[:, None] + torch.arange(3)
    expected[:, 2] = -torch.arange(300)
    assert torch.equal(staged.tensor, expected)


def test_overlapping_runs_on_triton_are_deduplicated_in_one_launch(monkeypatch) -> None:
    staged = StagedWriteTensor(torch.zeros(2, 5, dtype=torch.int64))
    staged.stage_write(0, 0, [1, 2, 3, 4, 5])
    staged.stage_write(1, 0, [6])
    staged.stage_write(0, 3, [7, 8])  # overlaps the first run: the later write wins
    with dispatch.kernels_on_cpu("triton"), count_launches(monkeypatch, "triton") as launches:
        staged.apply()
    # One launch over the 6 distinct elements written, as runs of one.
    assert launches == [6]
    assert staged.tensor.tolist() == [[1, 2, 3, 7, 8], [6, 0, 0, 0, 0]]


def test_runs_overlap() -> None:
    def overlap(runs: list[tuple[int, int]]) -> bool:
        starts, lengths = (np.array(x, dtype=np.int64) for x in zip(*runs)) if runs else (
            np.zeros(0, dtype=np.int64),) * 2
        return runs_overlap(starts, lengths)

    assert not overlap([])
    assert not overlap([(3, 4)])
    assert not overlap([(4, 2), (0, 4), (6, 1)])  # touching is not overlapping
    assert overlap([(0, 4), (3, 1)])
    assert overlap([(5, 1), (0, 10)])  # a later run covering an earlier one
    assert overlap([(0, 10), (12, 1), (4, 1)])  # inside a long run, not its neighbour
    assert overlap([(2, 1), (2, 1)])


def test_last_write_per_element() -> None:
    starts = np.array([0, 10, 2], dtype=np.int64)
    lengths = np.array([4, 1, 3], dtype=np.int64)
    values = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
    index, kept = last_write_per_element(starts, lengths, values)
    assert index.tolist() == [0, 1, 2, 3, 4, 10]
    assert kept.tolist() == [1, 2, 6, 7, 8, 5]


class FakeEvent:
    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def test_host_staging_alternates_two_buffers() -> None:
    staging = HostStaging(torch.device("cpu"))
    first = staging.host_buffer(16)
    first[:4] = [1, 2, 3, 4]
    assert staging.upload(4).tolist() == [1, 2, 3, 4]
    second = staging.host_buffer(16)
    assert not np.shares_memory(first, second)
    second[:2] = [9, 9]
    assert staging.upload(2).tolist() == [9, 9]
    assert np.shares_memory(staging.host_buffer(16), first)
    staging.upload(0)
    # Growing replaces the buffer; the other one is kept.
    grown = staging.host_buffer(1 << 20)
    assert len(grown) >= 1 << 20 and not np.shares_memory(grown, first)


def test_host_staging_waits_for_the_copy_before_refilling() -> None:
    """Invariant 5: the buffer being refilled is never one an in-flight copy reads."""
    staging = HostStaging(torch.device("cpu"))
    staging.host_buffer(8)
    staging.upload(8)
    event = FakeEvent()
    # As a CUDA upload leaves it: a copy from buffer 0 in flight, recorded on its event.
    staging._events[0], staging._in_flight[0] = event, True
    staging.host_buffer(8)  # buffer 1: no wait
    assert not event.waited
    staging.upload(8)
    staging.host_buffer(8)  # buffer 0 again: waits for its copy first
    assert event.waited and not staging._in_flight[0]
    event.waited = False
    staging.upload(8)  # on CPU nothing is recorded: the next refill does not wait again
    staging.host_buffer(8)
    staging.upload(8)
    staging.host_buffer(8)
    assert not event.waited


ROWS, COLS = 4, 6


@st.composite
def runs(draw):
    out = []
    for _ in range(draw(st.integers(0, 12))):
        row = draw(st.integers(0, ROWS - 1))
        start = draw(st.integers(0, COLS))
        values = draw(st.lists(st.integers(-1000, 1000), max_size=COLS - start))
        out.append((row, start, values))
    return out


@pytest.mark.parametrize("kernels", IMPLS)
@settings(max_examples=40, deadline=None)
@given(runs())
def test_matches_sequential_writes(kernels, staged_runs) -> None:
    initial = torch.arange(ROWS * COLS, dtype=torch.int32).view(ROWS, COLS)
    staged = StagedWriteTensor(initial.clone())
    expected = initial.clone()
    for row, start, values in staged_runs:
        staged.stage_write(row, start, values)
        expected[row, start:start + len(values)] = torch.tensor(values, dtype=torch.int32)
    with dispatch.kernels_on_cpu(kernels):
        staged.apply()
    assert torch.equal(staged.tensor, expected)
    assert num_staged(staged) == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_apply_matches_cpu_across_many_steps() -> None:
    """Compiled Triton kernel, pinned double-buffered staging, overlapping runs, growth."""
    rng = np.random.default_rng(0)
    shape = (8, 300)
    cpu = StagedWriteTensor(torch.zeros(shape, dtype=torch.int32))
    gpu = StagedWriteTensor(torch.zeros(shape, dtype=torch.int32, device="cuda"))
    for step in range(20):
        for _ in range(rng.integers(0, 12)):
            row, start = int(rng.integers(0, 8)), int(rng.integers(0, 300))
            values = rng.integers(-1000, 1000, int(rng.integers(0, 300 - start + 1)))
            cpu.stage_write(row, start, values)
            gpu.stage_write(row, start, values)
        cpu.apply()
        gpu.apply()
        # No synchronisation between steps: the double buffer keeps staging safe.
    assert all(buf.is_pinned() for buf in gpu._staging._pinned if buf is not None)
    assert any(buf is not None for buf in gpu._staging._pinned)
    assert torch.equal(gpu.tensor.cpu(), cpu.tensor)


def test_upload_array_on_cpu_is_the_array_itself() -> None:
    array = np.arange(6, dtype=np.int64)[::2]  # a strided view: made contiguous first
    tensor = upload_array(array, torch.device("cpu"))
    assert tensor.tolist() == [0, 2, 4] and tensor.is_contiguous()
    whole = np.arange(4, dtype=np.int32)
    assert np.shares_memory(upload_array(whole, torch.device("cpu")).numpy(), whole)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_upload_array_on_cuda_goes_through_pinned_memory() -> None:
    array = np.arange(1000, dtype=np.int64)
    tensor = upload_array(array, torch.device("cuda"))
    array[:] = -1  # the copy was made from a pinned snapshot, not from this buffer
    assert tensor.cpu().tolist() == list(range(1000))
