"""SamplingStates: per-slot sampling parameters, staged on add, and the host-only batch flags."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from mrv2.sampler.states import BatchFlags, SamplingStates, request_seed
from mrv2.sampling_params import SamplingParams
from sampler_harness import new_states
from staged_helpers import num_staged



def test_request_seed_is_stable_and_differs_per_request() -> None:
    params = SamplingParams()
    seed_a = request_seed(params, 7, "req-a")
    assert seed_a == request_seed(params, 7, "req-a")
    assert seed_a == request_seed(SamplingParams(temperature=0.5), 7, "req-a")
    # Stable across processes: a pure function of the engine seed and the id's bytes.
    assert seed_a == (7 * 0x9E3779B97F4A7C15 + zlib.crc32(b"req-a")) & (2**63 - 1)
    # Engine seeds that share their low bits still give different request seeds.
    assert len({request_seed(params, s, "req-a") for s in (0, 2**31, 2**32)}) == 3
    seeds = {request_seed(params, 7, f"req-{i}") for i in range(100)}
    assert len(seeds) == 100
    assert request_seed(params, 8, "req-a") != seed_a
    assert 0 <= seed_a < 2**63


def test_explicit_seed_is_respected() -> None:
    assert request_seed(SamplingParams(seed=1234), 7, "a") == 1234
    assert request_seed(SamplingParams(seed=1234), 99, "b") == 1234
    assert request_seed(SamplingParams(seed=0), 7, "a") == 0
    # Whatever the user passes fits the int64 seed table.
    for seed in (-1, 2**64 + 5, 2**63):
        assert 0 <= request_seed(SamplingParams(seed=seed), 0, "a") < 2**63


def make_states(num_slots: int, vocab_size: int = 100, **kwargs) -> SamplingStates:
    return new_states(num_slots, vocab_size, engine_seed=kwargs.pop("engine_seed", 3), **kwargs)


def test_add_stages_and_apply_writes_every_table() -> None:
    states = make_states(4)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11,
                            repetition_penalty=1.2, presence_penalty=0.5,
                            frequency_penalty=-0.5, min_tokens=2, stop_token_ids=[7])
    states.add(2, "a", params, [1, 2, 3], [1, 2, 3, 9])
    assert states.temperature.tensor[2].item() == 0.0  # staged only
    states.apply_staged_writes()
    expected = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11,
                    repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                    min_tokens=2)
    for name, value in expected.items():
        assert getattr(states, name).tensor[2].item() == pytest.approx(value), name
        assert getattr(states, f"{name}_host")[2] == pytest.approx(value), name
        assert getattr(states, name).tensor.is_contiguous()  # what the kernels index
    assert num_staged(states._table) == 0
    # Other slots keep the values of an empty slot.
    assert states.temperature.tensor[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    assert states.top_p.tensor[[0, 1, 3]].tolist() == [1.0, 1.0, 1.0]
    assert states.repetition_penalty.tensor[0].item() == 1.0
    # Stop ids for min_tokens: stop_token_ids (no EOS configured here).
    assert states.bias.stop_ids.lengths.tensor[2].item() == 1
    assert states.bias.stop_ids.ids[2, 0].item() == 7


def test_joining_requests_upload_every_scalar_table_in_one_staged_write(monkeypatch) -> None:
    """Every scalar table of every joining request goes up in one apply (one copy and one
    launch on CUDA), whatever the number of requests; seeds (8 bytes) included."""
    from mrv2.state import staged

    applied = []
    real_apply = staged.StagedWriteTensor.apply

    def counting_apply(self) -> None:
        applied.append(self)
        real_apply(self)

    monkeypatch.setattr(staged.StagedWriteTensor, "apply", counting_apply)
    states = make_states(8)
    for slot in (1, 4, 6):
        states.add(slot, f"r{slot}", SamplingParams(temperature=0.5, top_k=3, seed=2**40 + slot),
                   [1, 2])
    applied.clear()
    states.apply_staged_writes()
    scalar_applies = [t for t in applied if t is states._table]
    assert len(scalar_applies) == 1
    assert states.seed.tensor[[1, 4, 6]].tolist() == [2**40 + 1, 2**40 + 4, 2**40 + 6]
    assert states.top_k.tensor[[0, 1, 4]].tolist() == [0, 3, 3]
    assert states.temperature.tensor[6].item() == pytest.approx(0.5)


def test_derived_seed_stored_in_table() -> None:
    states = make_states(2, engine_seed=5)
    states.add(0, "x", SamplingParams(), [1])
    states.add(1, "y", SamplingParams(), [1])
    states.apply_staged_writes()
    assert states.seed.tensor.tolist() == [request_seed(SamplingParams(), 5, "x"),
                                           request_seed(SamplingParams(), 5, "y")]
    assert states.seed.tensor[0].item() != states.seed.tensor[1].item()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=1),
                                    SamplingParams(temperature=0.0, top_k=50),
                                    SamplingParams(temperature=1e-6, top_p=0.5)])
def test_greedy_requests_are_stored_as_temperature_zero(params: SamplingParams) -> None:
    states = make_states(2)
    states.add(0, "a", params, [1])
    states.add(1, "b", SamplingParams(temperature=0.8, top_k=-1), [1])
    states.apply_staged_writes()
    assert states.temperature.tensor[0].item() == 0.0
    assert states.temperature_host[0] == 0.0 and states.greedy_host[0]
    # -1 (disabled) is stored as 0 (disabled).
    assert states.top_k.tensor[1].item() == 0 and states.top_k_host[1] == 0
    assert states.temperature_host[1] == pytest.approx(0.8)
    flags = states.batch_flags(np.array([0]))
    assert flags.all_greedy and not flags.any_filter  # greedy rows ignore the filters


def test_reused_slot_is_overwritten() -> None:
    states = make_states(1)
    states.add(0, "a", SamplingParams(temperature=0.0, top_p=0.5, logit_bias={3: 1.0},
                                      allowed_token_ids=[1, 2], min_tokens=3,
                                      stop_token_ids=[5]), [1])
    states.apply_staged_writes()
    states.add(0, "b", SamplingParams(temperature=1.0), [1, 2])
    states.apply_staged_writes()
    assert states.temperature.tensor[0].item() == 1.0
    assert states.top_p.tensor[0].item() == 1.0 and states.top_p_host[0] == 1.0
    # The previous request's lists are cleared, not just unflagged.
    assert states.bias.bias.lengths.tensor[0].item() == 0
    assert states.bias.stop_ids.lengths.tensor[0].item() == 0
    assert states.bias.has_allowed.tensor[0].item() == 0
    assert states.min_tokens.tensor[0].item() == 0
    assert states.batch_flags(np.array([0])) == BatchFlags(all_greedy=False, all_random=True)


def test_same_slot_twice_in_one_step_keeps_the_last() -> None:
    states = make_states(2)
    states.add(1, "a", SamplingParams(temperature=0.5, seed=1), [1])
    states.add(1, "b", SamplingParams(temperature=0.9, seed=2), [1])
    states.apply_staged_writes()
    assert states.temperature.tensor[1].item() == pytest.approx(0.9)
    assert states.seed.tensor[1].item() == 2


def test_batch_flags_per_batch_subset() -> None:
    states = make_states(9, eos_token_ids=(0,))
    states.add(0, "greedy", SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1), [1])
    states.add(1, "plain", SamplingParams(temperature=1.0), [1])
    states.add(2, "topk", SamplingParams(temperature=1.0, top_k=10), [1])
    states.add(3, "topp", SamplingParams(temperature=0.5, top_p=0.8), [1])
    states.add(4, "minp", SamplingParams(temperature=0.5, min_p=0.2), [1])
    states.add(5, "bias", SamplingParams(temperature=0.0, logit_bias={4: 2.0}, logprobs=3), [1])
    states.add(6, "allowed", SamplingParams(allowed_token_ids=[1, 2], logprobs=0), [1])
    states.add(7, "min_tokens", SamplingParams(min_tokens=2), [1])
    states.add(8, "penalty", SamplingParams(temperature=0.0, presence_penalty=0.1), [1])
    states.apply_staged_writes()

    def flags(*slots: int) -> BatchFlags:
        return states.batch_flags(np.array(slots, dtype=np.int64))

    assert flags(0) == BatchFlags(all_greedy=True, all_random=False)
    assert flags(1) == BatchFlags(all_greedy=False, all_random=True)
    assert flags(0, 1) == BatchFlags(all_greedy=False, all_random=False)
    assert flags(2, 1) == BatchFlags(all_greedy=False, all_random=True, any_top_k=True,
                                     max_top_k=10)
    assert flags(3, 0) == BatchFlags(all_greedy=False, all_random=False, any_top_p=True)
    assert flags(4) == BatchFlags(all_greedy=False, all_random=True, any_min_p=True)
    assert flags(5) == BatchFlags(all_greedy=True, all_random=False, any_logit_bias=True,
                                  max_num_logprobs=3)
    assert flags(6, 1) == BatchFlags(all_greedy=False, all_random=True, any_allowed=True,
                                     max_num_logprobs=0)
    assert flags(7) == BatchFlags(all_greedy=False, all_random=True, any_min_tokens=True)
    assert flags(8) == BatchFlags(all_greedy=True, all_random=False, any_freq_pres=True)
    every = flags(*range(9))
    assert every.any_filter and every.any_processing and every.max_num_logprobs == 3
    assert every.max_top_k == 0  # slot 3 has top-p without top-k: a full sort is needed
    assert list(states.num_logprobs(np.array([5, 6, 1]))) == [3, 0, -1]


def test_batch_flags_are_kept_for_the_same_rows_until_a_slot_is_added() -> None:
    """A decode batch asks for its flags every step: the same rows get the flags computed
    last time, other rows new ones, and `add` (which changes the mirrors) drops them."""
    states = make_states(3)
    states.add(0, "a", SamplingParams(temperature=0.0), [1])
    states.add(1, "b", SamplingParams(temperature=0.0), [1])
    rows = np.array([0, 1], dtype=np.int64)
    first = states.batch_flags(rows)
    assert first.all_greedy
    assert states.batch_flags(rows.copy()) is first
    assert states.batch_flags(np.array([1, 0], dtype=np.int64)) is not first
    states.add(1, "c", SamplingParams(temperature=1.0, top_k=4, logprobs=2), [1])
    again = states.batch_flags(rows)
    assert again == BatchFlags(all_greedy=False, all_random=False, any_top_k=True,
                               max_top_k=4, max_num_logprobs=2)


def test_min_tokens_without_stop_ids_is_off() -> None:
    """min_tokens masks EOS + stop_token_ids; with ignore_eos and no stop ids nothing is masked,
    and a resumed request that already has min_tokens outputs needs no masking either."""
    states = make_states(3, eos_token_ids=(2,))
    states.add(0, "a", SamplingParams(min_tokens=4, ignore_eos=True), [1])
    states.add(1, "b", SamplingParams(min_tokens=2), [1], [1, 5, 6])
    states.add(2, "c", SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[9, 9, 500]),
               [1])
    states.apply_staged_writes()
    assert not states.batch_flags(np.array([0, 1])).any_min_tokens
    assert states.min_tokens.tensor[:2].tolist() == [0, 0]
    # Duplicates and ids outside the vocabulary (100 here) are dropped.
    assert states.bias.stop_ids.lengths.tensor[2].item() == 1
    assert states.bias.stop_ids.ids[2, 0].item() == 9


def test_min_tokens_masks_every_eos_id() -> None:
    """Every EOS id of the model and the request's own (primary) EOS are stop ids for
    min_tokens, with the request's stop_token_ids; ignore_eos leaves only the stop_token_ids."""
    states = make_states(3, eos_token_ids=(2, 7, 11))
    states.add(0, "a", SamplingParams(min_tokens=3, stop_token_ids=[40]), [1], eos_token_id=50)
    states.add(1, "b", SamplingParams(min_tokens=3, stop_token_ids=[40], ignore_eos=True), [1],
               eos_token_id=50)
    states.add(2, "c", SamplingParams(min_tokens=3), [1], eos_token_id=7)  # already a model EOS
    states.apply_staged_writes()

    def stop_ids(slot: int) -> list[int]:
        n = states.bias.stop_ids.lengths.tensor[slot].item()
        return states.bias.stop_ids.ids[slot, :n].tolist()

    assert stop_ids(0) == [2, 7, 11, 40, 50]
    assert stop_ids(1) == [40]
    assert stop_ids(2) == [2, 7, 11]


def test_optional_tables_are_allocated_on_first_use() -> None:
    vocab = 50_000
    states = make_states(64, vocab_size=vocab)
    for slot in range(64):
        states.add(slot, f"r{slot}", SamplingParams(temperature=0.7, top_k=5, logprobs=2),
                   [1, 2])
    states.apply_staged_writes()
    assert states.penalties.output_counts is None and states.penalties.prompt_mask.words is None
    assert states.bias.allowed.words is None and states.bias.bias.ids is None
    assert states.bias.stop_ids.ids is None
    # No table of this instance scales with the vocabulary until a feature asks for one.
    big = [t for t in _all_tensors(states) if t.numel() >= vocab]
    assert big == []
    states.add(3, "pen", SamplingParams(frequency_penalty=0.5), [1, 2])
    states.apply_staged_writes()
    assert states.penalties.output_counts.shape == (64, vocab)
    assert states.penalties.prompt_mask.words.shape == (64, (vocab + 31) // 32)


def _all_tensors(states: SamplingStates) -> list[torch.Tensor]:
    found = []
    for holder in (states, states.bias, states.penalties, states.bias.bias,
                   states.bias.stop_ids, states.bias.allowed, states.penalties.prompt_mask):
        for value in vars(holder).values():
            tensor = getattr(value, "tensor", value)
            if isinstance(tensor, torch.Tensor):
                found.append(tensor)
    return found


def test_max_top_k_covers_every_filtered_row() -> None:
    states = make_states(4)
    states.add(0, "a", SamplingParams(top_k=7, top_p=0.9), [1])
    states.add(1, "b", SamplingParams(top_k=30), [1])
    states.add(2, "c", SamplingParams(top_p=0.5), [1])
    states.add(3, "d", SamplingParams(temperature=0.0, top_k=90), [1])  # greedy: ignored
    states.apply_staged_writes()
    assert states.batch_flags(np.array([0, 1, 3])).max_top_k == 30
    assert states.batch_flags(np.array([0])).max_top_k == 7
    assert states.batch_flags(np.array([0, 2])).max_top_k == 0
