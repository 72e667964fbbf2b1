"""StagedWriteTensor: ragged host-side runs written to a persistent tensor with one indexed copy
(DESIGN.md invariant 3)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from mrv2.state.staged import StagedWriteTensor


class OpLog(TorchDispatchMode):
    """Records every aten op that runs inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(op == name for op in self.ops)


def test_ragged_runs_on_2d_tensor_applied_with_one_copy() -> None:
    staged = StagedWriteTensor(torch.zeros(4, 5, dtype=torch.int32))
    staged.stage_write(0, 1, [1, 2])
    staged.stage_write(3, 0, [3, 4, 5, 6, 7])
    staged.stage_write(2, 4, [8])
    staged.stage_write(1, 2, [9, 10, 11])
    assert staged.num_staged == 4
    with OpLog() as log:
        staged.apply()
    # One indexed write for all runs, nothing per row.
    assert log.count("aten.index_put_") == 1
    assert log.count("aten.copy_") == 0
    assert staged.tensor.tolist() == [
        [0, 1, 2, 0, 0],
        [0, 0, 9, 10, 11],
        [0, 0, 0, 0, 8],
        [3, 4, 5, 6, 7],
    ]


def test_1d_tensor_stage_set_and_write() -> None:
    staged = StagedWriteTensor(torch.zeros(6, dtype=torch.float32))
    staged.stage_set(1, 0.5)
    staged.stage_set(4, -2.25)
    staged.stage_write(5, 0, [7.0])
    with OpLog() as log:
        staged.apply()
    assert log.count("aten.index_put_") == 1
    assert staged.tensor.tolist() == [0.0, 0.5, 0.0, 0.0, -2.25, 7.0]


def test_stage_set_on_2d_sets_column_zero() -> None:
    staged = StagedWriteTensor(torch.full((2, 3), -1, dtype=torch.int64))
    staged.stage_set(1, 42)
    staged.apply()
    assert staged.tensor.tolist() == [[-1, -1, -1], [42, -1, -1]]


def test_int64_values_beyond_int32_survive() -> None:
    staged = StagedWriteTensor(torch.zeros(2, dtype=torch.int64))
    staged.stage_set(0, 2**62 + 3)
    staged.apply()
    assert staged.tensor[0].item() == 2**62 + 3


def test_later_write_to_same_element_wins() -> None:
    staged = StagedWriteTensor(torch.zeros(3, 4, dtype=torch.int32))
    staged.stage_write(0, 0, [1, 2, 3, 4])
    staged.stage_write(0, 1, [9])  # overwrites column 1 only
    staged.stage_write(2, 0, [5, 6])
    staged.stage_write(2, 1, [7, 8, 9])  # overlaps column 1 of the previous run
    staged.stage_write(0, 3, [11])
    staged.apply()
    assert staged.tensor.tolist() == [[1, 9, 3, 11], [0, 0, 0, 0], [5, 7, 8, 9]]


def test_later_write_wins_on_1d() -> None:
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
    assert staged.num_staged == 0 and flat.num_staged == 0
    # Exactly filling a row is fine.
    staged.stage_write(1, 1, [7, 8, 9])
    staged.apply()
    assert staged.tensor.tolist() == [[0, 0, 0, 0], [0, 7, 8, 9]]


def test_empty_run_is_not_staged() -> None:
    staged = StagedWriteTensor(torch.zeros(2, 4, dtype=torch.int32))
    staged.stage_write(1, 0, [])
    staged.stage_write(1, 4, [])  # zero values at the row's end is not an overflow
    assert staged.num_staged == 0


def test_apply_clears_staged_runs() -> None:
    staged = StagedWriteTensor(torch.zeros(2, 3, dtype=torch.int32))
    staged.stage_write(0, 0, [1, 2, 3])
    staged.apply()
    assert staged.num_staged == 0
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


def test_tensor_keeps_its_address() -> None:
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


@settings(max_examples=50, deadline=None)
@given(runs())
def test_matches_sequential_writes(staged_runs) -> None:
    initial = torch.arange(ROWS * COLS, dtype=torch.int32).view(ROWS, COLS)
    staged = StagedWriteTensor(initial.clone())
    expected = initial.clone()
    for row, start, values in staged_runs:
        staged.stage_write(row, start, values)
        expected[row, start:start + len(values)] = torch.tensor(values, dtype=torch.int32)
    staged.apply()
    assert torch.equal(staged.tensor, expected)
    assert staged.num_staged == 0
