"""Harness for the sampler tests: per-slot states built from SamplingParams, and a call
through the Sampler the way the runner makes it. Imported by module name (conftest.py puts
this folder on sys.path, as bench/conftest.py does)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mrv2.sampler import Sampler, SamplerOutput, SamplingStates
from mrv2.sampling_params import SamplingParams
from mrv2.platform import triton_interpreter
from mrv2.state.requests import RequestState

CPU = torch.device("cpu")


@dataclass
class Batch:
    """Requests in slots; rows of a batch point at slots through ``idx``."""

    states: SamplingStates
    idx: Tensor
    positions: Tensor
    prompts: list[list[int]] = field(default_factory=list)

    def sample(self, logits: Tensor, *, mode: str = "raw_logprobs",
               triton: bool = False) -> SamplerOutput:
        sampler = Sampler(self.states, logprobs_mode=mode)
        idx_np = self.idx.cpu().numpy()
        if triton:
            with triton_interpreter():
                return sampler(logits, self.idx, idx_np, self.positions)
        return sampler(logits, self.idx, idx_np, self.positions)


def new_states(num_slots: int, vocab_size: int, *, engine_seed: int = 0,
               device: torch.device = CPU, eos_token_ids: tuple[int, ...] = ()
               ) -> SamplingStates:
    """Sampling states over their own RequestState (which owns the slots' lengths)."""
    requests = RequestState(num_slots, max_model_len=1, device=device)
    return SamplingStates(requests, vocab_size, engine_seed, eos_token_ids=eos_token_ids)


def add_request(states: SamplingStates, slot: int, req_id: str, params: SamplingParams,
                prompt: list[int], prefill: list[int] | None = None, **kwargs) -> None:
    """What the runner stages for a joining request, at a slot the test chooses: its lengths
    in the RequestState (token history aside), its parameters in the SamplingStates."""
    prefill = prompt if prefill is None else prefill
    requests = states.requests
    requests.prompt_len.stage_set(slot, len(prompt))
    requests.prefill_len.stage_set(slot, len(prefill))
    requests.prompt_len_host[slot], requests.prefill_len_host[slot] = len(prompt), len(prefill)
    states.add(slot, req_id, params, prompt, prefill, **kwargs)


def apply_staged_writes(states: SamplingStates) -> None:
    states.requests.apply_staged_writes()
    states.apply_staged_writes()


def make_batch(params: list[SamplingParams], vocab_size: int, *,
               prompts: list[list[int]] | None = None,
               outputs: list[list[int]] | None = None, positions=None, idx=None,
               eos_token_id: int | None = None, num_slots: int | None = None,
               slots: list[int] | None = None, device: torch.device = CPU) -> Batch:
    """One request per params (slot i unless ``slots``); row r samples slot ``idx[r]``
    (default: row i -> request i) at ``positions[r]`` (default: right after its prefill).
    ``device`` holds the states and the batch tensors (CUDA: the compiled Triton path)."""
    n = len(params)
    prompts = prompts if prompts is not None else [[1, 2, 3]] * n
    outputs = outputs if outputs is not None else [[]] * n
    slots = slots if slots is not None else list(range(n))
    states = new_states(num_slots or max(slots) + 1, vocab_size, device=device,
                        eos_token_ids=() if eos_token_id is None else (eos_token_id,))
    for i, p in enumerate(params):
        add_request(states, slots[i], f"req-{i}", p, prompts[i], prompts[i] + outputs[i])
    apply_staged_writes(states)
    rows = torch.as_tensor(idx if idx is not None else slots, dtype=torch.int64)
    if positions is None:
        slot_of = {s: i for i, s in enumerate(slots)}
        positions = [len(prompts[slot_of[s]]) + len(outputs[slot_of[s]]) for s in rows.tolist()]
    positions = torch.as_tensor(positions, dtype=torch.int64).expand(len(rows)).contiguous()
    return Batch(states, rows.to(device), positions.to(device), prompts)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
