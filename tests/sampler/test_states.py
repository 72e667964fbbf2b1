"""SamplingStates: per-slot sampling parameters, staged on add, and the host-only batch flags."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from mrv2.sampler.states import SamplingStates, request_seed
from mrv2.sampling_params import SamplingParams

CPU = torch.device("cpu")


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


def test_add_stages_and_apply_writes_every_table() -> None:
    states = SamplingStates(4, engine_seed=3, device=CPU)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11)
    states.add(2, "a", params)
    assert states.temperature.tensor[2].item() == 0.0  # staged only
    states.apply_staged_writes()
    assert states.temperature.tensor[2].item() == pytest.approx(0.7)
    assert states.top_k.tensor[2].item() == 20
    assert states.top_p.tensor[2].item() == pytest.approx(0.9)
    assert states.min_p.tensor[2].item() == pytest.approx(0.05)
    assert states.seed.tensor[2].item() == 11
    assert states.temperature_host[2] == pytest.approx(0.7)
    assert states.top_k_host[2] == 20
    assert states.top_p_host[2] == pytest.approx(0.9)
    assert states.min_p_host[2] == pytest.approx(0.05)
    # Other slots keep their defaults.
    assert states.temperature.tensor[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]
    for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
        assert getattr(states, name).num_staged == 0


def test_derived_seed_stored_in_table() -> None:
    states = SamplingStates(2, engine_seed=5, device=CPU)
    states.add(0, "x", SamplingParams())
    states.add(1, "y", SamplingParams())
    states.apply_staged_writes()
    assert states.seed.tensor.tolist() == [request_seed(SamplingParams(), 5, "x"),
                                           request_seed(SamplingParams(), 5, "y")]
    assert states.seed.tensor[0].item() != states.seed.tensor[1].item()


def test_top_k_one_is_stored_as_greedy() -> None:
    states = SamplingStates(2, engine_seed=0, device=CPU)
    states.add(0, "a", SamplingParams(temperature=0.8, top_k=1))
    states.add(1, "b", SamplingParams(temperature=0.8, top_k=-1))
    states.apply_staged_writes()
    assert states.temperature.tensor[0].item() == 0.0
    assert states.temperature_host[0] == 0.0
    # -1 (disabled) is stored as 0 (disabled).
    assert states.top_k.tensor[1].item() == 0 and states.top_k_host[1] == 0
    assert states.temperature_host[1] == pytest.approx(0.8)
    assert states.batch_flags(np.array([0]))["all_greedy"]


def test_reused_slot_is_overwritten() -> None:
    states = SamplingStates(1, engine_seed=0, device=CPU)
    states.add(0, "a", SamplingParams(temperature=0.0, top_p=0.5))
    states.apply_staged_writes()
    states.add(0, "b", SamplingParams(temperature=1.0))
    states.apply_staged_writes()
    assert states.temperature.tensor[0].item() == 1.0
    assert states.top_p.tensor[0].item() == 1.0 and states.top_p_host[0] == 1.0


def test_batch_flags_per_batch_subset() -> None:
    states = SamplingStates(5, engine_seed=0, device=CPU)
    states.add(0, "greedy", SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1))
    states.add(1, "plain", SamplingParams(temperature=1.0))
    states.add(2, "topk", SamplingParams(temperature=1.0, top_k=10))
    states.add(3, "topp", SamplingParams(temperature=0.5, top_p=0.8))
    states.add(4, "minp", SamplingParams(temperature=0.5, min_p=0.2))

    def flags(*slots: int) -> dict[str, bool]:
        return states.batch_flags(np.array(slots, dtype=np.int64))

    assert flags(0) == dict(all_greedy=True, all_random=False, any_top_k=False,
                            any_top_p=False, any_min_p=False)  # greedy rows ignore filters
    assert flags(1) == dict(all_greedy=False, all_random=True, any_top_k=False,
                            any_top_p=False, any_min_p=False)
    assert flags(0, 1) == dict(all_greedy=False, all_random=False, any_top_k=False,
                               any_top_p=False, any_min_p=False)
    assert flags(2, 1) == dict(all_greedy=False, all_random=True, any_top_k=True,
                               any_top_p=False, any_min_p=False)
    assert flags(3, 0) == dict(all_greedy=False, all_random=False, any_top_k=False,
                               any_top_p=True, any_min_p=False)
    assert flags(4) == dict(all_greedy=False, all_random=True, any_top_k=False,
                            any_top_p=False, any_min_p=True)
    assert flags(4, 3, 2, 1, 0) == dict(all_greedy=False, all_random=False, any_top_k=True,
                                        any_top_p=True, any_min_p=True)
