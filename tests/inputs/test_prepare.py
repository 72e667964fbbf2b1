"""prepare_inputs: one step's inputs gathered from the slot state into the persistent step
buffers (DESIGN.md section 2 step 5, invariants 2 and 6). Also covers InputBuffers and
InputBatch.

The state is built by hand the way the runner builds it: add -> apply -> post_update after each
"sampled" step, with the host mirror of num_computed advanced as the runner does. Every test
that prepares inputs runs with the numba CPU kernels and with the Triton kernels (interpreted on
CPU tensors, TRITON_INTERPRET=1); one test compares the two buffer for buffer, padding included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
# Imported here, outside the interpreter, as a full test run does (other tests use compiled
# Triton): Triton's own jitted helpers (tl.zeros, tl.cdiv, ...) then fail under the
# interpreter, so the kernels must not use them.
import triton.language  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from mrv2.inputs.batch import InputBatch
from mrv2.inputs.buffers import InputBuffers
from mrv2.inputs.prepare import decode_first_order, prepare_inputs, verify_rows
from mrv2 import platform as dispatch
from mrv2.state.block_table import BlockTables
from mrv2.state.requests import RequestState

from input_batch_helpers import num_reqs, num_reqs_padded, num_tokens_padded

CPU = torch.device("cpu")
BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
MAX_BLOCKS = MAX_MODEL_LEN // BLOCK_SIZE
BUFFER_NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens",
                "idx_mapping", "num_scheduled", "logits_indices", "block_tables")


IMPLS = ["cpu", "triton"]


@pytest.fixture(params=IMPLS)
def impl(request):
    """The test runs with the numba kernels, then with the Triton ones (interpreted)."""
    with dispatch.kernels_on_cpu(request.param):
        yield request.param


@dataclass
class Req:
    """What the test knows about one request: its full token history and block ids."""

    req_id: str
    slot: int
    history: list[int]
    prefill_len: int
    num_computed: int
    block_ids: list[int] = field(default_factory=list)


class World:
    def __init__(self, max_num_seqs: int = 6, max_num_tokens: int = 64,
                 device: torch.device = CPU) -> None:
        self.state = RequestState(max_num_seqs, MAX_MODEL_LEN, device)
        self.tables = BlockTables(max_num_seqs, MAX_BLOCKS, BLOCK_SIZE, device)
        self.buffers = InputBuffers(max_num_tokens, max_num_seqs, MAX_BLOCKS, device)
        self.reqs: dict[str, Req] = {}
        self.next_block = 1

    def add(self, req_id: str, prefill: list[int], num_computed: int = 0,
            prompt_len: int | None = None) -> Req:
        slot = self.state.add(req_id, prompt_len or len(prefill), prefill, num_computed)
        req = Req(req_id, slot, list(prefill), len(prefill), num_computed)
        self.reqs[req_id] = req
        return req

    def finish(self, req_id: str) -> None:
        slot = self.state.finish(req_id)
        self.tables.clear_row(slot)
        del self.reqs[req_id]

    def ensure_blocks(self, req: Req, num_tokens: int) -> None:
        """Allocate blocks so that `num_tokens` tokens fit (new ids, staged as a delta)."""
        needed = -(-num_tokens // BLOCK_SIZE) - len(req.block_ids)
        if needed > 0:
            new = list(range(self.next_block, self.next_block + needed))
            self.next_block += needed
            # Scramble block ids so that a wrong row or column shows.
            new = [b * 7 % 997 for b in new]
            self.tables.append_block_ids(req.slot, new, overwrite=not req.block_ids)
            req.block_ids += new

    def apply(self) -> None:
        self.state.apply_staged_writes()
        self.tables.apply_staged_writes()

    def sample(self, steps: list[tuple[str, int, int]]) -> None:
        """Run post_update for rows (req_id, num_scheduled, sampled token), as the runner does
        after a forward pass, and advance the host mirror."""
        reqs = [self.reqs[r] for r, _, _ in steps]
        slots = np.array([r.slot for r in reqs], dtype=np.int64)
        num_scheduled = np.array([n for _, n, _ in steps], dtype=np.int32)
        device = self.buffers.input_ids.device
        sampled = torch.tensor([t for _, _, t in steps], dtype=torch.int64, device=device)
        self.state.post_update(torch.from_numpy(slots).to(device),
                               torch.from_numpy(num_scheduled).to(device), sampled)
        self.state.advance_num_computed_host(slots, num_scheduled)
        for req, (_, n, token) in zip(reqs, steps):
            req.num_computed += n
            if req.num_computed >= req.prefill_len:
                del req.history[req.num_computed:]
                req.history.append(token)

    def prepare(self, scheduled: dict[str, int], buffers: InputBuffers | None = None,
                **padding) -> InputBatch:
        req_ids = list(scheduled)
        num_scheduled = np.array([scheduled[r] for r in req_ids], dtype=np.int32)
        slots = np.array([self.reqs[r].slot for r in req_ids], dtype=np.int64)
        order = decode_first_order(num_scheduled > 1)
        return prepare_inputs([req_ids[i] for i in order], slots[order], num_scheduled[order],
                              self.state, self.tables, buffers or self.buffers, **padding)


def reference(world: World, req_ids: list[str], scheduled: dict[str, int]) -> dict:
    """Straightforward per-request, per-token expected values, rows in the given order."""
    input_ids, positions, slot_mapping, qsl, seq_lens, tables = [], [], [], [0], [], []
    for req_id in req_ids:
        req, n = world.reqs[req_id], scheduled[req_id]
        for pos in range(req.num_computed, req.num_computed + n):
            input_ids.append(req.history[pos])
            positions.append(pos)
            block = req.block_ids[pos // BLOCK_SIZE]
            slot_mapping.append(block * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(qsl[-1] + n)
        seq_lens.append(req.num_computed + n)
        tables.append(req.block_ids)
    return dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                query_start_loc=qsl, seq_lens=seq_lens, logits_indices=[q - 1 for q in qsl[1:]],
                tables=tables)


def check_against_reference(world: World, batch: InputBatch, scheduled: dict[str, int]) -> None:
    """Real rows and tokens against the reference; padded ones against invariant 6."""
    ref = reference(world, batch.req_ids, scheduled)
    meta = batch.attn_metadata
    n, r = batch.num_tokens, num_reqs(batch)
    n_pad, r_pad = num_tokens_padded(batch), num_reqs_padded(batch)
    assert batch.num_tokens == meta.num_actual_tokens == len(ref["input_ids"])
    assert num_reqs(batch) == meta.num_reqs == len(scheduled)
    assert sorted(batch.req_ids) == sorted(scheduled)
    assert batch.input_ids.tolist() == ref["input_ids"] + [0] * (n_pad - n)
    assert batch.positions.tolist() == ref["positions"] + [0] * (n_pad - n)
    padded_qsl = ref["query_start_loc"] + [n] * (r_pad - r)
    assert meta.query_start_loc.tolist() == padded_qsl
    assert meta.query_start_loc_np.tolist() == padded_qsl
    assert meta.seq_lens.tolist() == ref["seq_lens"] + [0] * (r_pad - r)
    assert meta.seq_lens_np.tolist() == ref["seq_lens"] + [0] * (r_pad - r)
    assert meta.max_seq_len == max(ref["seq_lens"])
    assert meta.slot_mapping.tolist() == ref["slot_mapping"] + [-1] * (n_pad - n)
    assert batch.logits_indices.tolist() == ref["logits_indices"]
    assert meta.block_tables.shape[0] == r_pad
    for row, ids in enumerate(ref["tables"]):
        assert meta.block_tables[row, :len(ids)].tolist() == ids
    assert (meta.block_tables[r:] == 0).all()
    assert batch.idx_mapping.tolist() == [world.reqs[r].slot for r in batch.req_ids]
    assert batch.idx_mapping_np.tolist() == batch.idx_mapping.tolist()
    assert batch.num_scheduled.tolist() == [scheduled[r] for r in batch.req_ids]
    assert batch.num_scheduled_np.tolist() == batch.num_scheduled.tolist()
    num_scheduled = [scheduled[r] for r in batch.req_ids]
    num_decodes = sum(n == 1 for n in num_scheduled)
    assert meta.num_decodes == num_decodes
    assert all(n == 1 for n in num_scheduled[:num_decodes])  # decode rows first
    assert all(n > 1 for n in num_scheduled[num_decodes:])
    # Padding of the persistent slot_mapping: nothing past the real tokens writes the cache.
    assert (world.buffers.slot_mapping[0, batch.num_tokens:] == -1).all()
    assert meta.other_groups == ()  # one KV cache group


def mixed_world() -> tuple[World, dict[str, int]]:
    """Two decode rows (one resumed), a prefill chunk over a cached prefix, a fresh prompt."""
    w = World()
    w.add("filler", [1])  # so that slots differ from batch rows
    d1 = w.add("d1", [101, 102, 103, 104, 105])
    d2 = w.add("d2", [201, 202, 203, 204, 205, 206, 207, 208, 209], num_computed=4,
               prompt_len=6)  # resumed: 6 prompt tokens + 3 outputs
    w.finish("filler")
    for req in (d1, d2):
        w.ensure_blocks(req, req.prefill_len)
    w.apply()
    # d1 runs its prompt and samples 150, d2 its remaining 5 and samples 250.
    w.sample([("d1", 5, 150), ("d2", 5, 250)])
    # Next step: d1 decodes once more and samples 151 (position 5 -> token at index 6).
    w.ensure_blocks(d1, 6)
    w.apply()
    w.sample([("d1", 1, 151)])
    c1 = w.add("c1", list(range(300, 311)), num_computed=4)  # 4-token cached prefix
    c2 = w.add("c2", [400, 401, 402])
    w.ensure_blocks(c1, 9)
    w.ensure_blocks(c2, 3)
    w.ensure_blocks(d1, 8)
    w.ensure_blocks(d2, 11)
    w.apply()
    # The scheduler's order: prefills interleaved with decodes.
    scheduled = {"c1": 5, "d1": 1, "c2": 3, "d2": 1}
    return w, scheduled


def test_decode_first_order_is_stable() -> None:
    order = decode_first_order(np.array([5, 1, 3, 1, 1, 2]) > 1)
    assert order.tolist() == [1, 3, 4, 0, 2, 5]
    assert decode_first_order(np.array([], dtype=bool)).tolist() == []
    assert decode_first_order(np.array([4, 4]) > 1).tolist() == [0, 1]


def test_input_buffers_shapes_and_dtypes() -> None:
    buffers = InputBuffers(16, 4, 3, CPU)
    assert buffers.max_num_tokens == 16 and buffers.max_num_reqs == 4
    for name in ("input_ids", "positions"):
        assert getattr(buffers, name).shape == (16,)
    assert buffers.slot_mapping.shape == (1, 16)  # [KV cache groups, tokens]
    # Padding-safe from the start: a warm-up run before the first step writes no KV.
    assert (buffers.slot_mapping == -1).all()
    assert buffers.query_start_loc.shape == (5,)
    assert buffers.query_start_loc.dtype == torch.int32
    assert buffers.seq_lens.shape == (4,) and buffers.seq_lens.dtype == torch.int32
    assert buffers.idx_mapping.shape == buffers.logits_indices.shape == (4,)
    assert buffers.block_tables.shape == (1, 4, 3) and buffers.block_tables.dtype == torch.int32
    assert InputBuffers(16, 4, 3, CPU, num_kv_groups=2).block_tables.shape == (2, 4, 3)
    assert InputBuffers(16, 4, 3, CPU, num_kv_groups=2).slot_mapping.shape == (2, 16)
    assert buffers.slot_mapping.dtype == torch.int64
    # prepare_inputs gathers token ids straight into input_ids: the dtypes must agree.
    state = RequestState(4, 8, CPU)
    assert buffers.input_ids.dtype == state.token_ids.tensor.dtype


def test_mixed_batch_matches_hand_computed_values(impl) -> None:
    w, scheduled = mixed_world()
    batch = w.prepare(scheduled)
    assert batch.req_ids == ["d1", "d2", "c1", "c2"]
    d1, d2, c1, c2 = (w.reqs[r] for r in batch.req_ids)
    # Decode rows feed the last sampled token (written on the device by post_update).
    assert batch.input_ids.tolist() == [151, 250, 304, 305, 306, 307, 308, 400, 401, 402]
    assert batch.positions.tolist() == [6, 9, 4, 5, 6, 7, 8, 0, 1, 2]
    meta = batch.attn_metadata
    assert meta.query_start_loc.tolist() == [0, 1, 2, 7, 10]
    assert meta.query_start_loc_np.tolist() == [0, 1, 2, 7, 10]
    assert meta.seq_lens.tolist() == [7, 10, 9, 3]
    assert meta.seq_lens_np.tolist() == [7, 10, 9, 3]
    assert meta.max_seq_len == 10
    assert meta.num_decodes == 2
    assert meta.num_actual_tokens == batch.num_tokens == 10
    assert batch.logits_indices.tolist() == [0, 1, 6, 9]
    assert batch.idx_mapping.tolist() == [d1.slot, d2.slot, c1.slot, c2.slot]
    assert meta.slot_mapping.tolist()[:2] == [d1.block_ids[1] * 4 + 2, d2.block_ids[2] * 4 + 1]
    check_against_reference(w, batch, scheduled)


def test_returns_views_of_the_persistent_buffers(impl) -> None:
    w, scheduled = mixed_world()
    buffers = w.buffers
    batch = w.prepare(scheduled)
    meta = batch.attn_metadata
    pairs = [
        (batch.input_ids, buffers.input_ids),
        (batch.positions, buffers.positions),
        (batch.idx_mapping, buffers.idx_mapping),
        (batch.num_scheduled, buffers.num_scheduled),
        (batch.logits_indices, buffers.logits_indices),
        (meta.query_start_loc, buffers.query_start_loc),
        (meta.seq_lens, buffers.seq_lens),
        (meta.slot_mapping, buffers.slot_mapping),
        (meta.block_tables, buffers.block_tables),
    ]
    for view, buf in pairs:
        assert view.data_ptr() == buf.data_ptr()
    # A second, smaller step writes the same addresses.
    w.sample([(r, n, 900 + i) for i, (r, n) in enumerate(scheduled.items())])
    w.ensure_blocks(w.reqs["c1"], 10)
    w.apply()
    second = {"c1": 1, "d1": 1}
    batch2 = w.prepare(second)
    assert batch2.input_ids.data_ptr() == buffers.input_ids.data_ptr()
    assert batch2.attn_metadata.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    assert batch2.attn_metadata.block_tables.data_ptr() == buffers.block_tables.data_ptr()
    check_against_reference(w, batch2, second)


def test_decode_token_is_the_last_sampled(impl) -> None:
    w = World()
    req = w.add("a", [5, 6, 7])
    w.ensure_blocks(req, 3)
    w.apply()
    w.sample([("a", 3, 42)])
    for token in (43, 44, 45):
        w.ensure_blocks(req, req.num_computed + 1)
        w.apply()
        batch = w.prepare({"a": 1})
        assert batch.input_ids.tolist() == [req.history[-1]]
        assert batch.positions.tolist() == [req.num_computed]
        check_against_reference(w, batch, {"a": 1})
        w.sample([("a", 1, token)])
    assert req.history == [5, 6, 7, 42, 43, 44, 45]
    assert w.state.token_ids.tensor[req.slot, :7].tolist() == req.history


def test_exceeding_token_capacity_raises_value_error(impl) -> None:
    w = World(max_num_seqs=4, max_num_tokens=8)
    for r in "ab":
        req = w.add(r, list(range(10, 15)))
        w.ensure_blocks(req, 5)
    w.apply()
    with pytest.raises(ValueError):
        w.prepare({"a": 5, "b": 4})


def test_exceeding_row_capacity_raises_value_error(impl) -> None:
    w = World(max_num_seqs=4, max_num_tokens=64)
    for r in "abcd":
        req = w.add(r, [1, 2])
        w.ensure_blocks(req, 2)
    w.apply()
    scheduled = {r: 2 for r in "abcd"}
    req_ids = list(scheduled)
    slots = np.array([0, 1, 2, 3, 0], dtype=np.int64)  # a fifth row exceeds max_num_reqs
    with pytest.raises(ValueError):
        prepare_inputs(req_ids + ["a"], slots, np.full(5, 2, dtype=np.int32), w.state,
                       w.tables, w.buffers)


# ---- property test against the per-request reference -------------------------------------


@st.composite
def scenarios(draw):
    """Requests in random states: ("prefill", prefill_len, num_computed, num_scheduled) or
    ("decode", prefill_len, num_decode_steps_already_done), plus padding for the batch."""
    specs = []
    for _ in range(draw(st.integers(1, 5))):
        prefill_len = draw(st.integers(1, 20))
        if draw(st.booleans()):
            computed = draw(st.integers(0, prefill_len - 1))
            scheduled = draw(st.integers(1, prefill_len - computed))
            specs.append(("prefill", prefill_len, computed, scheduled))
        else:
            specs.append(("decode", prefill_len, draw(st.integers(0, 3))))
    num_fillers = draw(st.integers(0, 2))
    padding = (draw(st.integers(0, 20)), draw(st.integers(0, 8 - len(specs))))
    return specs, num_fillers, padding, draw(st.randoms(use_true_random=False))


def build_scenario(scenario) -> tuple[World, dict[str, int], dict[str, int]]:
    """(world, scheduled in random order, padding kwargs) for a drawn scenario."""
    specs, num_fillers, (pad_tokens, pad_reqs), rng = scenario
    w = World(max_num_seqs=8, max_num_tokens=128)
    for i in range(num_fillers):
        w.add(f"filler{i}", [1])
    scheduled: dict[str, int] = {}
    for i, spec in enumerate(specs):
        prefill_len = spec[1]
        req = w.add(f"r{i}", [rng.randrange(1000) for _ in range(prefill_len)],
                    num_computed=spec[2] if spec[0] == "prefill" else 0)
        if spec[0] == "prefill":
            w.ensure_blocks(req, spec[2] + spec[3])
            scheduled[req.req_id] = spec[3]
        else:
            w.ensure_blocks(req, prefill_len + spec[2] + 1)
            scheduled[req.req_id] = 1
    for i in range(num_fillers):
        w.finish(f"filler{i}")
    w.apply()
    # Bring decode rows to their state: the whole prefill, then some decode steps.
    decodes = [(f"r{i}", s) for i, s in enumerate(specs) if s[0] == "decode"]
    if decodes:
        w.sample([(r, s[1], rng.randrange(1000)) for r, s in decodes])
        for k in range(max(s[2] for _, s in decodes)):
            w.sample([(r, 1, rng.randrange(1000)) for r, s in decodes if s[2] > k])
    order = list(scheduled)
    rng.shuffle(order)
    scheduled = {r: scheduled[r] for r in order}
    padding = dict(num_tokens_padded=sum(scheduled.values()) + pad_tokens,
                   num_reqs_padded=len(scheduled) + pad_reqs)
    return w, scheduled, padding


@pytest.mark.parametrize("kernels", IMPLS)
@settings(max_examples=25, deadline=None)
@given(scenarios())
def test_matches_per_request_reference(kernels, scenario) -> None:
    """The whole flow (staged apply, post_update, prepare, gather) on one implementation."""
    with dispatch.kernels_on_cpu(kernels):
        w, scheduled, padding = build_scenario(scenario)
        check_against_reference(w, w.prepare(scheduled), scheduled)
        w.buffers.slot_mapping.fill_(7)  # stale values: padding must overwrite them
        check_against_reference(w, w.prepare(scheduled, **padding), scheduled)


@pytest.mark.parametrize("kernels", IMPLS)
@settings(max_examples=15, deadline=None)
@given(scenarios())
def test_each_rows_seq_len_is_one_past_its_last_token(kernels, scenario) -> None:
    """The runner passes seq_lens to the sampler as the positions of the tokens it samples
    (one past each row's last token)."""
    with dispatch.kernels_on_cpu(kernels):
        w, scheduled, padding = build_scenario(scenario)
        batch = w.prepare(scheduled, **padding)
        last = batch.positions[batch.logits_indices]
        assert torch.equal(batch.attn_metadata.seq_lens[:len(scheduled)].long(), last + 1)


def garbage_buffers(w: World) -> InputBuffers:
    buffers = InputBuffers(w.buffers.max_num_tokens, w.buffers.max_num_reqs, MAX_BLOCKS, CPU)
    for name in BUFFER_NAMES:
        getattr(buffers, name).fill_(77)
    return buffers


@settings(max_examples=20, deadline=None)
@given(scenarios())
def test_triton_kernels_match_cpu_kernels_buffer_for_buffer(scenario) -> None:
    """Same state, both implementations, every byte of every step buffer (padded tails and
    the stale entries past them included)."""
    w, scheduled, padding = build_scenario(scenario)
    for pad in ({}, padding):
        cpu, triton = garbage_buffers(w), garbage_buffers(w)
        with dispatch.kernels_on_cpu("cpu"):
            w.prepare(scheduled, cpu, **pad)
        with dispatch.kernels_on_cpu("triton"):
            w.prepare(scheduled, triton, **pad)
        for name in BUFFER_NAMES:
            assert torch.equal(getattr(cpu, name), getattr(triton, name)), name


def test_padding_follows_invariant_6(impl) -> None:
    w, scheduled = mixed_world()
    for name in BUFFER_NAMES:
        getattr(w.buffers, name).fill_(55)
    batch = w.prepare(scheduled, num_tokens_padded=16, num_reqs_padded=6)
    meta = batch.attn_metadata
    assert (batch.num_tokens, num_tokens_padded(batch)) == (10, 16)
    assert (num_reqs(batch), num_reqs_padded(batch)) == (4, 6)
    assert meta.num_actual_tokens == 10 and meta.num_reqs == 4
    assert batch.input_ids.shape == batch.positions.shape == meta.slot_mapping.shape == (16,)
    assert meta.query_start_loc.tolist() == [0, 1, 2, 7, 10, 10, 10]
    assert meta.seq_lens.tolist() == [7, 10, 9, 3, 0, 0]
    assert meta.block_tables.shape == (6, MAX_BLOCKS)
    assert (meta.block_tables[4:] == 0).all()
    assert batch.input_ids[10:].tolist() == [0] * 6
    assert batch.positions[10:].tolist() == [0] * 6
    assert (w.buffers.slot_mapping[0, 10:] == -1).all()  # to the buffer's end
    # Real rows only where the sampler reads.
    assert batch.logits_indices.tolist() == [0, 1, 6, 9]
    assert batch.idx_mapping.shape == batch.num_scheduled.shape == (4,)
    check_against_reference(w, batch, scheduled)


def test_padding_sizes_are_checked(impl) -> None:
    w, scheduled = mixed_world()  # 10 tokens, 4 rows; capacity 64 tokens, 6 rows
    with pytest.raises(ValueError):
        w.prepare(scheduled, num_tokens_padded=9)
    with pytest.raises(ValueError):
        w.prepare(scheduled, num_tokens_padded=65)
    with pytest.raises(ValueError):
        w.prepare(scheduled, num_reqs_padded=3)
    with pytest.raises(ValueError):
        w.prepare(scheduled, num_reqs_padded=7)
    batch = w.prepare(scheduled, num_tokens_padded=64, num_reqs_padded=6)
    check_against_reference(w, batch, scheduled)


def test_decode_token_comes_from_last_sampled_not_the_history(impl) -> None:
    w = World()
    req = w.add("a", [5, 6, 7])
    w.ensure_blocks(req, 4)
    w.apply()
    w.sample([("a", 3, 42)])
    # Spoil the history where the sampled token was appended: the decode input must not read it.
    w.state.token_ids.tensor[req.slot, 3] = -1
    batch = w.prepare({"a": 1})
    assert batch.input_ids.tolist() == [42]


def test_one_token_chunk_inside_a_prefill_reads_the_history(impl) -> None:
    """A query of one token is not necessarily a decode: mid-prefill it is a prompt token."""
    w = World()
    req = w.add("a", [5, 6, 7, 8], num_computed=1)
    w.ensure_blocks(req, 4)
    w.apply()
    batch = w.prepare({"a": 1})  # position 1 of a 4-token prompt
    assert batch.input_ids.tolist() == [6]
    assert batch.attn_metadata.num_decodes == 1  # one query token: the decode path serves it
    check_against_reference(w, batch, {"a": 1})
    w.sample([("a", 1, 999)])  # prefill incomplete: nothing sampled
    batch = w.prepare({"a": 2})  # the rest of the prompt; the last token is prompt[-1]
    assert batch.input_ids.tolist() == [7, 8]
    check_against_reference(w, batch, {"a": 2})


def test_row_past_max_model_len_raises(impl) -> None:
    w = World()
    req = w.add("a", list(range(MAX_MODEL_LEN)), num_computed=MAX_MODEL_LEN - 1)
    w.ensure_blocks(req, MAX_MODEL_LEN)
    w.apply()
    check_against_reference(w, w.prepare({"a": 1}), {"a": 1})  # exactly full is fine
    w.state.set_num_computed_host(np.array([req.slot]), np.array([MAX_MODEL_LEN]))
    with pytest.raises(ValueError):
        w.prepare({"a": 1})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu() -> None:
    """Compiled Triton kernels on CUDA against the numba kernels, padding included."""
    worlds = [World(), World(device=torch.device("cuda"))]
    results = []
    for w in worlds:
        d1 = w.add("d1", [101, 102, 103, 104, 105])
        c1 = w.add("c1", list(range(300, 311)), num_computed=4)
        w.ensure_blocks(d1, 6)
        w.ensure_blocks(c1, 9)
        w.apply()
        w.sample([("d1", 5, 150)])
        w.ensure_blocks(d1, 7)
        w.apply()
        w.prepare({"c1": 5, "d1": 1}, num_tokens_padded=12, num_reqs_padded=4)
        results.append({name: getattr(w.buffers, name).cpu() for name in BUFFER_NAMES})
    for name in BUFFER_NAMES:
        assert torch.equal(results[0][name], results[1][name]), name


def test_verify_rows_split_a_row_per_token(impl) -> None:
    """A verify row (the sampled token and its drafts) becomes one decode row per token: each
    at its own position, attending to its request's keys up to itself; the drafts' ids come
    from the token history, where the proposer wrote them."""
    w = World()
    a, b = w.add("a", [5, 6, 7]), w.add("b", [1, 2])
    for req in (a, b):
        w.ensure_blocks(req, 8)
    w.apply()
    w.sample([("a", 3, 42), ("b", 2, 9)])
    w.state.token_ids.numpy[a.slot, 4:6] = [43, 44]  # a's drafts, after its history
    row_ids, slots, scheduled, offsets, first_row = verify_rows(
        ["a", "b"], np.array([a.slot, b.slot]), np.array([3, 1], np.int32),
        np.array([True, False]))
    assert row_ids == ["a", "a", "a", "b"] and first_row.tolist() == [0, 3]
    assert scheduled.tolist() == [1, 1, 1, 1] and offsets.tolist() == [0, 1, 2, 0]
    batch = prepare_inputs(row_ids, slots, scheduled, w.state, w.tables, w.buffers,
                           offsets=offsets)
    assert batch.input_ids.tolist() == [42, 43, 44, 9]
    assert batch.positions.tolist() == [3, 4, 5, 2]
    assert batch.attn_metadata.seq_lens.tolist() == [4, 5, 6, 3]
    assert batch.attn_metadata.num_decodes == 4
    table = a.block_ids
    expected = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in (3, 4, 5)]
    assert batch.attn_metadata.slot_mapping[:3].tolist() == expected
    # A catch-up before num_computed (a draft model's, an EAGLE head's): history tokens.
    batch = prepare_inputs(["a"], np.array([a.slot]), np.array([3], np.int32), w.state,
                           w.tables, w.buffers, offsets=np.array([-2], np.int32))
    assert batch.input_ids[:3].tolist() == [6, 7, 42]
    assert batch.positions[:3].tolist() == [1, 2, 3]
