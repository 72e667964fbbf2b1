"""BlockTables: staged deltas, overwrite on (re)add, gather in batch order (with padded rows),
and the torch slot-mapping reference (block_table_helpers.py). Every test runs with the numba
CPU kernels and with the Triton kernels (interpreted on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
# Imported here, outside the interpreter, as a full test run does (other tests use compiled
# Triton): Triton's own jitted helpers (tl.zeros, tl.cdiv, ...) then fail under the
# interpreter, so the kernels must not use them.
import triton.language  # noqa: F401

from mrv2 import platform as dispatch
from mrv2.protocol import NULL_BLOCK_ID
from mrv2.state.block_table import BlockTables

from block_table_helpers import append_block_ids_batch, compute_slot_mapping
from staged_helpers import num_staged

CPU = torch.device("cpu")


@pytest.fixture(params=["cpu", "triton"], autouse=True)
def impl(request):
    with dispatch.kernels_on_cpu(request.param):
        yield request.param


def make_tables(max_num_seqs: int = 4, max_blocks: int = 4, block_size: int = 4) -> BlockTables:
    return BlockTables(max_num_seqs, max_blocks, block_size, CPU)


def test_starts_as_null_blocks() -> None:
    tables = make_tables()
    assert tables.table.tensor.shape == (4, 4)
    assert tables.table.tensor.dtype == torch.int32
    assert (tables.table.tensor == NULL_BLOCK_ID).all()
    assert tables.num_blocks.tolist() == [0, 0, 0, 0]


def test_append_stages_only_the_delta() -> None:
    tables = make_tables()
    tables.append_block_ids(1, [5, 6])
    assert num_staged(tables.table) == 1
    assert tables.num_blocks[1] == 2
    assert tables.table.tensor[1].tolist() == [0, 0, 0, 0]  # staged, not yet written
    tables.apply_staged_writes()
    assert num_staged(tables.table) == 0
    assert tables.table.tensor[1].tolist() == [5, 6, 0, 0]
    # Mark the already-written entries: a delta append must not touch them.
    tables.table.tensor[1, :2] = -7
    tables.append_block_ids(1, [8])
    assert num_staged(tables.table) == 1
    tables.apply_staged_writes()
    assert tables.table.tensor[1].tolist() == [-7, -7, 8, 0]
    assert tables.num_blocks[1] == 3


def test_empty_append_stages_nothing() -> None:
    tables = make_tables()
    tables.append_block_ids(0, [3])
    tables.apply_staged_writes()
    tables.append_block_ids(0, [])
    assert num_staged(tables.table) == 0
    assert tables.num_blocks[0] == 1


def test_several_rows_one_apply() -> None:
    tables = make_tables()
    tables.append_block_ids(0, [1, 2])
    tables.append_block_ids(2, [3])
    tables.append_block_ids(0, [4])
    assert num_staged(tables.table) == 3
    tables.apply_staged_writes()
    assert tables.table.tensor.tolist() == [[1, 2, 4, 0], [0, 0, 0, 0], [3, 0, 0, 0],
                                            [0, 0, 0, 0]]


def test_overwrite_resets_the_row() -> None:
    tables = make_tables()
    tables.append_block_ids(0, [1, 2, 3])
    tables.apply_staged_writes()
    tables.append_block_ids(0, [9], overwrite=True)
    assert tables.num_blocks[0] == 1
    tables.apply_staged_writes()
    assert tables.table.tensor[0, 0].item() == 9
    tables.append_block_ids(0, [10])
    tables.apply_staged_writes()
    assert tables.table.tensor[0, :2].tolist() == [9, 10]
    assert tables.num_blocks[0] == 2


def test_clear_row_restarts_the_fill() -> None:
    tables = make_tables()
    tables.append_block_ids(3, [1, 2, 3, 4])
    tables.clear_row(3)
    assert tables.num_blocks[3] == 0
    tables.append_block_ids(3, [5, 6, 7, 8])  # a full row again: no overflow after clearing
    tables.apply_staged_writes()
    assert tables.table.tensor[3].tolist() == [5, 6, 7, 8]


def test_overflow_beyond_max_blocks_raises() -> None:
    tables = make_tables(max_blocks=3)
    tables.append_block_ids(0, [1, 2])
    with pytest.raises(ValueError):
        tables.append_block_ids(0, [3, 4])
    assert tables.num_blocks[0] == 2
    assert num_staged(tables.table) == 1  # the refused append staged nothing
    with pytest.raises(ValueError):
        tables.append_block_ids(1, [1, 2, 3, 4], overwrite=True)
    tables.append_block_ids(0, [3])  # exactly full is fine
    tables.apply_staged_writes()
    assert tables.table.tensor[0, :3].tolist() == [1, 2, 3]


def test_append_block_ids_batch_equals_one_by_one() -> None:
    one_by_one, batched = make_tables(), make_tables()
    for tables in (one_by_one, batched):
        tables.append_block_ids(0, [1, 2])
        tables.append_block_ids(2, [3])
        tables.apply_staged_writes()
    deltas = {2: [7, 8], 0: [], 3: [9], 1: [4, 5, 6, 10]}
    for slot, ids in deltas.items():
        one_by_one.append_block_ids(slot, ids)
    append_block_ids_batch(batched, np.array(list(deltas)), list(deltas.values()))
    assert num_staged(batched.table) == num_staged(one_by_one.table) == 3
    for tables in (one_by_one, batched):
        tables.apply_staged_writes()
    assert batched.table.tensor.tolist() == one_by_one.table.tensor.tolist() == [
        [1, 2, 0, 0], [4, 5, 6, 10], [3, 7, 8, 0], [9, 0, 0, 0]]
    assert batched.num_blocks.tolist() == one_by_one.num_blocks.tolist() == [2, 4, 3, 1]


def test_append_block_id_runs_equals_the_list_form() -> None:
    """The packed form (CachedRequestData: flat ids + a count per slot) stages the same."""
    deltas = [[5, 6], [], [7]]
    by_lists, by_runs = make_tables(), make_tables()
    slots = np.array([2, 0, 1])
    append_block_ids_batch(by_lists, slots, deltas)
    by_runs.append_block_id_runs(slots, np.array([2, 0, 1], np.int32),
                                 np.array([5, 6, 7], np.int32))
    for t in (by_lists, by_runs):
        t.apply_staged_writes()
    assert by_runs.num_blocks.tolist() == by_lists.num_blocks.tolist() == [0, 1, 2, 0]
    assert by_runs.table.tensor.tolist() == by_lists.table.tensor.tolist()
    with pytest.raises(ValueError, match="summing to 3 and 2 block ids"):
        by_runs.append_block_id_runs(slots, np.array([2, 0, 1]), np.array([5, 6]))


def test_append_block_ids_batch_overflow_raises_and_stages_nothing() -> None:
    tables = make_tables(max_blocks=3)
    tables.append_block_ids(1, [1, 2])
    tables.apply_staged_writes()
    with pytest.raises(ValueError, match="slot 1"):
        append_block_ids_batch(tables, np.array([0, 1]), [[5], [6, 7]])
    assert num_staged(tables.table) == 0
    assert tables.num_blocks.tolist() == [0, 2, 0, 0]
    with pytest.raises(ValueError):
        append_block_ids_batch(tables, np.array([0]), [[1], [2]])
    append_block_ids_batch(tables, np.array([0, 1]), [[], []])
    assert num_staged(tables.table) == 0


def test_gather_block_tables_in_batch_order_into_persistent_buffer() -> None:
    tables = make_tables()
    for slot, ids in enumerate([[1], [2, 3], [4, 5, 6], [7]]):
        tables.append_block_ids(slot, ids)
    tables.apply_staged_writes()
    out = torch.full((1, 4, 4), -1, dtype=torch.int32)  # [groups, rows, blocks]
    rows = tables.gather_block_tables(torch.tensor([2, 0, 3]), out)
    assert rows.data_ptr() == out.data_ptr()
    assert rows.shape == (1, 3, 4)
    assert rows.tolist() == [[[4, 5, 6, 0], [1, 0, 0, 0], [7, 0, 0, 0]]]
    assert out[0, 3].tolist() == [-1, -1, -1, -1]  # beyond the batch: untouched
    # A later, smaller batch reuses the same buffer.
    rows = tables.gather_block_tables(torch.tensor([1]), out)
    assert rows.data_ptr() == out.data_ptr()
    assert out[0, 0].tolist() == [2, 3, 0, 0]


def test_gather_pads_rows_with_the_null_block() -> None:
    tables = make_tables()
    for slot, ids in enumerate([[1], [2, 3], [4, 5, 6], [7, 8, 9, 10]]):
        tables.append_block_ids(slot, ids)
    tables.apply_staged_writes()
    out = torch.full((1, 4, 4), -1, dtype=torch.int32)
    rows = tables.gather_block_tables(torch.tensor([3, 1]), out, num_rows_padded=4)
    assert rows.data_ptr() == out.data_ptr()
    assert rows.tolist() == [[[7, 8, 9, 10], [2, 3, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]
    # Padding only as far as asked; an empty batch may be padded too.
    out.fill_(-1)
    assert tables.gather_block_tables(torch.tensor([0]), out, 2).tolist() == [[[1, 0, 0, 0],
                                                                                 [0, 0, 0, 0]]]
    assert out[0, 2:].tolist() == [[-1] * 4] * 2
    assert tables.gather_block_tables(torch.zeros(0, dtype=torch.int64), out, 1).tolist() == [
        [[0, 0, 0, 0]]]
    with pytest.raises(ValueError):
        tables.gather_block_tables(torch.tensor([0, 1]), out, num_rows_padded=1)
    with pytest.raises(ValueError):
        tables.gather_block_tables(torch.tensor([0]), out, num_rows_padded=5)


def test_gather_wide_rows_matches_index_select() -> None:
    """Rows wider than one Triton column block; random tables and batches."""
    rng = np.random.default_rng(0)
    tables = BlockTables(5, 700, 16, CPU)
    for slot in range(5):
        tables.append_block_ids(slot, rng.integers(1, 10_000, rng.integers(1, 701)).tolist())
    tables.apply_staged_writes()
    out = torch.full((1, 5, 700), -1, dtype=torch.int32)
    for _ in range(3):
        idx = torch.from_numpy(rng.permutation(5)[:rng.integers(1, 6)])
        rows = tables.gather_block_tables(idx, out, num_rows_padded=5)
        expected = torch.zeros(1, 5, 700, dtype=torch.int32)
        expected[0, :len(idx)] = tables.table.tensor[idx]
        assert torch.equal(rows, expected)


def test_groups_have_their_own_rows() -> None:
    """Two KV cache groups: group g's row of slot s is table row g * max_num_seqs + s; the
    packed runs are group-major, clear_row clears every group's row and a gather fills
    [groups, rows, blocks]."""
    tables = BlockTables(3, 4, 4, CPU, num_groups=2)
    assert tables.table.tensor.shape == (6, 4) and tables.num_blocks.tolist() == [0] * 6
    tables.append_block_ids(1, [1, 2])
    tables.append_block_ids(1, [5, 6], group=1)
    # Slots 2 and 1: group 0 gets [3] and [], group 1 gets [7, 8] and [9].
    tables.append_block_id_runs(np.array([2, 1]), np.array([[1, 0], [2, 1]]),
                                np.array([3, 7, 8, 9]))
    tables.apply_staged_writes()
    assert tables.num_blocks.tolist() == [0, 2, 1, 0, 3, 2]
    assert tables.table.tensor.tolist() == [[0, 0, 0, 0], [1, 2, 0, 0], [3, 0, 0, 0],
                                            [0, 0, 0, 0], [5, 6, 9, 0], [7, 8, 0, 0]]
    out = torch.full((2, 3, 4), -1, dtype=torch.int32)
    rows = tables.gather_block_tables(torch.tensor([2, 1]), out, num_rows_padded=3)
    assert rows.data_ptr() == out.data_ptr()
    assert rows.tolist() == [[[3, 0, 0, 0], [1, 2, 0, 0], [0, 0, 0, 0]],
                             [[7, 8, 0, 0], [5, 6, 9, 0], [0, 0, 0, 0]]]
    token_slots, positions = torch.tensor([1, 2]), torch.tensor([5, 4])
    mapping = compute_slot_mapping(tables, token_slots, positions,
                                   torch.zeros(2, dtype=torch.int64), group=1)
    assert mapping.tolist() == [6 * 4 + 1, 8 * 4 + 0]
    with pytest.raises(ValueError, match="2 KV cache groups"):
        tables.append_block_id_runs(np.array([0]), np.array([1]), np.array([4]))
    tables.clear_row(1)
    assert tables.num_blocks.tolist() == [0, 0, 1, 0, 0, 2]


def test_compute_slot_mapping_formula_and_padding() -> None:
    block_size = 4
    tables = make_tables(max_blocks=4, block_size=block_size)
    block_ids = {0: [11, 12, 13], 2: [21, 22]}
    for slot, ids in block_ids.items():
        tables.append_block_ids(slot, ids)
    tables.apply_staged_writes()
    token_slots = torch.tensor([2, 2, 0, 0, 0, 0, 0, 0], dtype=torch.int64)
    positions = torch.tensor([4, 7, 3, 4, 5, 6, 7, 8], dtype=torch.int64)
    out = torch.zeros(12, dtype=torch.int64)
    mapping = compute_slot_mapping(tables, token_slots, positions, out)
    expected = [block_ids[s][p // block_size] * block_size + p % block_size
                for s, p in zip(token_slots.tolist(), positions.tolist())]
    assert mapping.tolist() == expected
    assert expected[:3] == [22 * 4 + 0, 22 * 4 + 3, 11 * 4 + 3]
    assert mapping.data_ptr() == out.data_ptr()
    assert out[8:].tolist() == [-1] * 4
    # A shorter step pads the stale tail with -1 again.
    mapping = compute_slot_mapping(tables, token_slots[:2], positions[:2], out)
    assert mapping.tolist() == expected[:2]
    assert out[2:].tolist() == [-1] * 10


def test_compute_slot_mapping_no_tokens() -> None:
    tables = make_tables()
    out = torch.zeros(5, dtype=torch.int64)
    mapping = compute_slot_mapping(tables, torch.zeros(0, dtype=torch.int64),
                                   torch.zeros(0, dtype=torch.int64), out)
    assert mapping.numel() == 0
    assert out.tolist() == [-1] * 5


def test_a_narrow_group_stages_its_ids_scaled() -> None:
    """A group whose caches are narrower than the KV tensors (block_scale 2: Gemma 4's windowed
    layers beside wider global heads) addresses block id b as its block 2b, in both forms."""
    tables = BlockTables(2, 4, 4, CPU, num_groups=2, block_scales=(2, 1))
    tables.append_block_ids(0, [3, 5], group=0)
    tables.append_block_ids(0, [3, 5], group=1)
    tables.append_block_id_runs(np.array([1]), np.array([[1], [2]]), np.array([7, 8, 9]))
    tables.apply_staged_writes()
    rows = tables.table.tensor.tolist()
    assert rows[0][:2] == [6, 10] and rows[1][:1] == [14]  # group 0: slots 0 and 1
    assert rows[2][:2] == [3, 5] and rows[3][:2] == [8, 9]  # group 1 unscaled
