"""RequestState: fixed slots (DESIGN.md invariant 1), staged adds, and the device-side
post_update that advances counters after sampling (invariant 4).

Every test runs twice: with the numba CPU kernels and with the Triton kernels (interpreted on
CPU tensors, TRITON_INTERPRET=1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
# Imported here, outside the interpreter, as a full test run does (other tests use compiled
# Triton): Triton's own jitted helpers (tl.zeros, tl.cdiv, ...) then fail under the
# interpreter, so the kernels must not use them.
import triton.language  # noqa: F401

from mrv2 import platform as dispatch
from mrv2.state.requests import RequestState

CPU = torch.device("cpu")


@pytest.fixture(params=["cpu", "triton"], autouse=True)
def impl(request):
    with dispatch.kernels_on_cpu(request.param):
        yield request.param


def make_state(max_num_seqs: int = 4, max_model_len: int = 16) -> RequestState:
    return RequestState(max_num_seqs, max_model_len, CPU)


def step(state: RequestState, slots: list[int], num_scheduled: list[int],
         sampled: list[int]) -> None:
    state.post_update(torch.tensor(slots, dtype=torch.int64),
                      torch.tensor(num_scheduled, dtype=torch.int32),
                      torch.tensor(sampled, dtype=torch.int64))


def test_add_stages_and_apply_writes_the_row() -> None:
    state = make_state()
    slot = state.add("a", 3, [5, 6, 7, 8], 1)
    assert slot == 0
    # Nothing reaches the tensors before apply.
    assert state.token_ids.tensor[0].sum().item() == 0
    state.apply_staged_writes()
    assert state.token_ids.tensor[0, :4].tolist() == [5, 6, 7, 8]
    assert state.prompt_len.tensor[0].item() == 3
    assert state.prefill_len.tensor[0].item() == 4
    assert state.num_computed.tensor[0].item() == 1
    assert state.total_len.tensor[0].item() == 4
    assert state.last_sampled.tensor[0].item() == 8
    assert state.prompt_len_host[0] == 3
    assert state.prefill_len_host[0] == 4
    assert state.num_computed_host[0] == 1
    assert state.req_id_to_slot == {"a": 0}
    assert state.num_active == 1 and state.num_free_slots == 3


def test_host_mirror_follows_the_scheduler_then_the_step() -> None:
    """The runner sets running rows' counts from the scheduler, then advances them by the
    step's scheduled tokens; a row sampled once its prefill is complete, as on the device."""
    state = make_state()
    a = state.add("a", 3, [5, 6, 7, 8], 0)
    b = state.add("b", 2, [1, 2], 0)
    slots = np.array([a, b])
    state.set_num_computed_host(slots, np.array([2, 1]))
    assert state.num_computed_host[slots].tolist() == [2, 1]
    is_sampling = state.advance_num_computed_host(slots, np.array([1, 1], dtype=np.int32))
    assert state.num_computed_host[slots].tolist() == [3, 2]
    assert is_sampling.tolist() == [False, True]
    assert state.advance_num_computed_host(slots[:1], np.array([1])).tolist() == [True]


def test_slots_never_move() -> None:
    state = make_state()
    assert [state.add(r, 1, [1], 0) for r in "abc"] == [0, 1, 2]
    assert state.finish("b") == 1
    assert state.req_id_to_slot == {"a": 0, "c": 2}
    assert state.add("d", 1, [1], 0) == 1  # the freed slot, not a compaction
    assert state.add("e", 1, [1], 0) == 3
    assert state.req_id_to_slot == {"a": 0, "c": 2, "d": 1, "e": 3}
    state.finish("a")
    assert state.req_id_to_slot == {"c": 2, "d": 1, "e": 3}


def test_slots_of() -> None:
    state = make_state()
    for r in "abc":
        state.add(r, 1, [1], 0)
    state.finish("a")
    slots = state.slots_of(["c", "b"])
    assert slots.dtype == np.int64 and slots.tolist() == [2, 1]
    assert state.slots_of([]).tolist() == []
    with pytest.raises(KeyError):
        state.slots_of(["a"])


def test_free_slots_start_lowest_first_and_freed_slots_are_reused() -> None:
    state = make_state(max_num_seqs=6)
    assert [state.add(r, 1, [1], 0) for r in "abcd"] == [0, 1, 2, 3]
    state.finish("c")
    state.finish("a")
    # Freed slots are reused before never-used ones (a stack: the last freed comes back first).
    reused = [state.add(r, 1, [1], 0) for r in "xy"]
    assert sorted(reused) == [0, 2]
    assert reused == [0, 2]
    # Then the never-used slots, lowest first.
    assert [state.add(r, 1, [1], 0) for r in "zw"] == [4, 5]


def test_adding_beyond_capacity_raises() -> None:
    state = make_state(max_num_seqs=2)
    state.add("a", 1, [1], 0)
    state.add("b", 1, [1], 0)
    with pytest.raises(RuntimeError, match="no free slot"):
        state.add("c", 1, [1], 0)
    assert state.req_id_to_slot == {"a": 0, "b": 1}
    state.finish("a")
    assert state.add("c", 1, [1], 0) == 0


def test_add_rejects_duplicates_and_overlong_prefill() -> None:
    state = make_state(max_num_seqs=3, max_model_len=4)
    state.add("a", 1, [1], 0)
    with pytest.raises(ValueError):
        state.add("a", 1, [1], 0)
    with pytest.raises(ValueError):
        state.add("b", 5, [1, 2, 3, 4, 5], 0)
    # A refused add takes no slot.
    assert state.num_free_slots == 2
    assert state.add("b", 4, [1, 2, 3, 4], 0) == 1


def test_finish_unknown_is_noop_and_finishing_twice_frees_once() -> None:
    state = make_state(max_num_seqs=3)
    state.add("a", 1, [1], 0)
    state.add("b", 1, [1], 0)
    assert state.finish("nope") is None
    assert state.num_free_slots == 1
    assert state.finish("a") == 0
    assert state.finish("a") is None
    assert state.num_free_slots == 2
    assert state.add("c", 1, [1], 0) == 0
    assert state.add("d", 1, [1], 0) == 2
    with pytest.raises(RuntimeError):
        state.add("e", 1, [1], 0)


def test_post_update_incomplete_prefill_samples_nothing() -> None:
    state = make_state()
    state.add("p", 6, [10, 11, 12, 13, 14, 15], 0)
    state.apply_staged_writes()
    before = state.token_ids.tensor.clone()
    step(state, [0], [4], [99])
    assert state.num_computed.tensor[0].item() == 4
    assert torch.equal(state.token_ids.tensor, before)
    assert state.last_sampled.tensor[0].item() == 15
    assert state.total_len.tensor[0].item() == 6
    # The rest of the prefill completes it: the token lands right after the prompt.
    step(state, [0], [2], [99])
    assert state.num_computed.tensor[0].item() == 6
    assert state.token_ids.tensor[0, :7].tolist() == [10, 11, 12, 13, 14, 15, 99]
    assert state.last_sampled.tensor[0].item() == 99
    assert state.total_len.tensor[0].item() == 7


def test_post_update_mixed_batch_then_decode() -> None:
    state = make_state(max_num_seqs=5)
    state.add("filler", 1, [1], 0)  # keeps slots from matching batch rows
    slot_q = state.add("q", 3, [20, 21, 22], 0)
    slot_p = state.add("p", 6, [30, 31, 32, 33, 34, 35], 2)
    state.finish("filler")
    state.apply_staged_writes()
    untouched = state.token_ids.tensor[0].clone()
    # Batch rows are (p, q): p gets a chunk that stays incomplete, q finishes its prompt.
    step(state, [slot_p, slot_q], [3, 3], [777, 501])
    assert state.num_computed.tensor[[slot_p, slot_q]].tolist() == [5, 3]
    assert state.token_ids.tensor[slot_p, :7].tolist() == [30, 31, 32, 33, 34, 35, 0]
    assert state.last_sampled.tensor[slot_p].item() == 35
    assert state.total_len.tensor[slot_p].item() == 6
    assert state.token_ids.tensor[slot_q, :5].tolist() == [20, 21, 22, 501, 0]
    assert state.last_sampled.tensor[slot_q].item() == 501
    assert state.total_len.tensor[slot_q].item() == 4
    # Decode q, finish p's prefill, in the other row order.
    step(state, [slot_q, slot_p], [1, 1], [502, 601])
    assert state.num_computed.tensor[[slot_p, slot_q]].tolist() == [6, 4]
    assert state.token_ids.tensor[slot_q, :6].tolist() == [20, 21, 22, 501, 502, 0]
    assert state.last_sampled.tensor[slot_q].item() == 502
    assert state.total_len.tensor[slot_q].item() == 5
    assert state.token_ids.tensor[slot_p, :7].tolist() == [30, 31, 32, 33, 34, 35, 601]
    assert state.last_sampled.tensor[slot_p].item() == 601
    assert state.total_len.tensor[slot_p].item() == 7
    # Slots outside the batch are untouched.
    assert torch.equal(state.token_ids.tensor[0], untouched)
    assert state.num_computed.tensor[0].item() == 0


def test_resumed_request_prefills_prompt_plus_outputs() -> None:
    state = make_state()
    prompt, outputs = [1, 2, 3], [4, 5]
    slot = state.add("r", len(prompt), prompt + outputs, 2)  # 2 tokens from the prefix cache
    state.apply_staged_writes()
    assert state.prompt_len_host[slot] == 3
    assert state.prefill_len_host[slot] == 5
    assert state.last_sampled.tensor[slot].item() == 5
    step(state, [slot], [3], [6])
    assert state.num_computed.tensor[slot].item() == 5
    assert state.token_ids.tensor[slot, :6].tolist() == [1, 2, 3, 4, 5, 6]
    assert state.last_sampled.tensor[slot].item() == 6
    assert state.total_len.tensor[slot].item() == 6


def test_reused_slot_is_rewritten_by_add() -> None:
    state = make_state(max_num_seqs=1)
    state.add("a", 2, [7, 8], 0)
    state.apply_staged_writes()
    step(state, [0], [2], [9])
    state.finish("a")
    assert state.add("b", 3, [1, 2, 3], 1) == 0
    state.apply_staged_writes()
    assert state.token_ids.tensor[0, :3].tolist() == [1, 2, 3]
    assert state.num_computed.tensor[0].item() == 1
    assert state.total_len.tensor[0].item() == 3
    assert state.last_sampled.tensor[0].item() == 3
    assert state.prompt_len_host[0] == 3 and state.num_computed_host[0] == 1


def test_finish_and_readd_in_one_step_later_write_wins() -> None:
    """Preemption is finish + re-add; both adds are staged before one apply."""
    state = make_state(max_num_seqs=1)
    state.add("a", 2, [7, 8], 0)
    state.finish("a")
    state.add("a", 3, [1, 2, 3], 0)
    state.apply_staged_writes()
    assert state.token_ids.tensor[0, :3].tolist() == [1, 2, 3]
    assert state.prefill_len.tensor[0].item() == 3
    assert state.last_sampled.tensor[0].item() == 3


def random_state(rng: np.random.Generator, max_num_seqs: int = 6, max_model_len: int = 12,
                 device: str = "cpu") -> tuple[RequestState, dict]:
    """Random per-slot state plus a random batch over distinct slots (some rows finish their
    prefill, some do not, some reach the end of max_model_len)."""
    state = RequestState(max_num_seqs, max_model_len, torch.device(device))
    for i in range(max_num_seqs):
        prefill = rng.integers(1, 500, rng.integers(1, max_model_len + 1)).tolist()
        state.add(f"r{i}", len(prefill), prefill, int(rng.integers(0, len(prefill))))
    state.apply_staged_writes()
    num_reqs = int(rng.integers(1, max_num_seqs + 1))
    slots = rng.permutation(max_num_seqs)[:num_reqs]
    computed = state.num_computed.tensor.cpu().numpy()[slots]
    num_scheduled = rng.integers(1, max_model_len - computed + 1)
    batch = dict(idx_mapping=torch.tensor(slots, dtype=torch.int64),
                 num_scheduled=torch.tensor(num_scheduled, dtype=torch.int32),
                 sampled=torch.tensor(rng.integers(500, 1000, num_reqs), dtype=torch.int64))
    return state, batch


def state_tensors(state: RequestState) -> list[torch.Tensor]:
    return [t.tensor.cpu() for t in (state.token_ids, state.prefill_len, state.num_computed,
                                     state.total_len, state.last_sampled)]


def test_post_update_matches_reference_on_random_batches(impl) -> None:
    """Both kernels against a per-row Python reference."""
    rng = np.random.default_rng(7)
    for _ in range(15):
        state, batch = random_state(rng)
        history, prefill_len, computed, total_len, last = (t.clone() for t in
                                                          state_tensors(state))
        for slot, n, token in zip(*(batch[k].tolist() for k in batch)):
            computed[slot] += n
            if computed[slot] >= prefill_len[slot]:
                history[slot, min(int(computed[slot]), state.max_model_len - 1)] = token
                total_len[slot] = computed[slot] + 1
                last[slot] = token
        state.post_update(**batch)
        for got, want in zip(state_tensors(state), (history, prefill_len, computed, total_len,
                                                    last)):
            assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_post_update_on_cuda_matches_cpu(impl) -> None:
    if impl != "cpu":
        pytest.skip("one run is enough: CUDA tensors always take the compiled Triton path")
    rng_cpu, rng_gpu = np.random.default_rng(3), np.random.default_rng(3)
    for _ in range(10):
        cpu_state, cpu_batch = random_state(rng_cpu)
        gpu_state, gpu_batch = random_state(rng_gpu, device="cuda")
        cpu_state.post_update(**cpu_batch)
        gpu_state.post_update(**{k: v.cuda() for k, v in gpu_batch.items()})
        for got, want in zip(state_tensors(gpu_state), state_tensors(cpu_state)):
            assert torch.equal(got, want)


def test_post_update_steps_is_post_update_for_each_column(impl) -> None:
    """A run of decode steps (one token a row a step) in one call: the state of post_update
    applied to each column in turn, the prefill rows' completion and the history's last
    position included (both kernels)."""
    rng = np.random.default_rng(11)
    for _ in range(10):
        state, batch = random_state(rng)
        twin, _ = random_state(np.random.default_rng(0))
        for name in ("token_ids", "prefill_len", "num_computed", "total_len", "last_sampled"):
            getattr(twin, name).tensor.copy_(getattr(state, name).tensor)
        rows = batch["idx_mapping"].shape[0]
        sampled = torch.tensor(rng.integers(500, 1000, (rows, 4)), dtype=torch.int64)
        state.post_update_steps(batch["idx_mapping"], sampled)
        for s in range(4):
            twin.post_update(batch["idx_mapping"], torch.ones(rows, dtype=torch.int32),
                             sampled[:, s])
        for got, want in zip(state_tensors(state), state_tensors(twin)):
            assert torch.equal(got, want)
