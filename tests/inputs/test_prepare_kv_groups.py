"""prepare_inputs over a hybrid KV layout (core/kv_cache_layout.py): each KV cache group's
block-table rows and KV slots, group 0's in the metadata and the others' in `other_groups`,
with the numba kernels and the Triton ones (interpreted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton.language  # noqa: F401  (imported outside the interpreter, as test_prepare.py)

from mrv2 import platform as dispatch
from mrv2.inputs.buffers import InputBuffers
from mrv2.inputs.prepare import prepare_inputs
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState

CPU = torch.device("cpu")
BLOCK_SIZE, MAX_BLOCKS, GROUPS = 4, 6, 3


@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_every_group_gets_its_own_tables_and_slots(impl) -> None:
    state = RequestState(4, BLOCK_SIZE * MAX_BLOCKS, CPU)
    tables = BlockTables(4, MAX_BLOCKS, BLOCK_SIZE, CPU, num_groups=GROUPS)
    buffers = InputBuffers(16, 4, MAX_BLOCKS, CPU, num_kv_groups=GROUPS)
    prompts = {"a": list(range(10, 19)), "b": list(range(30, 36))}  # 9 and 6 tokens
    blocks = {"a": [[1, 2, 3], [0, 7, 8], [11, 12, 13]], "b": [[4, 5], [9, 10], [14, 15]]}
    slots = []
    for req_id, prompt in prompts.items():
        slot = state.add(req_id, len(prompt), prompt, 0)
        for group, ids in enumerate(blocks[req_id]):
            tables.append_block_ids(slot, ids, overwrite=True, group=group)
        slots.append(slot)
    state.apply_staged_writes()
    tables.apply_staged_writes()
    # a: its 9 tokens after none computed; b: 6 tokens. Padded to 3 rows and 16 tokens.
    with dispatch.kernels_on_cpu(impl):
        batch = prepare_inputs(["a", "b"], np.array(slots), np.array([9, 6], np.int32), state,
                               tables, buffers, num_tokens_padded=16, num_reqs_padded=3)
    meta = batch.attn_metadata
    assert len(meta.other_groups) == GROUPS - 1
    positions = list(range(9)) + list(range(6))
    for group in range(GROUPS):
        group_meta = meta.for_group(group)
        table = group_meta.block_tables.tolist()
        assert table[0][:3] == blocks["a"][group] and table[1][:2] == blocks["b"][group]
        assert table[2] == [0] * MAX_BLOCKS  # the padded row: the null block
        ids = blocks["a"][group], blocks["b"][group]
        expected = [ids[0 if t < 9 else 1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    for t, p in enumerate(positions)]
        assert group_meta.slot_mapping.tolist() == expected + [-1]
        assert group_meta.seq_lens is meta.seq_lens
