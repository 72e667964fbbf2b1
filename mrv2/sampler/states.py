"""Per-slot sampling parameters, staged when a request is added (DESIGN.md invariants 2-4).

The sampler reads every parameter through the batch-row -> slot mapping, so no per-step
parameter tensor is built in Python. Host mirrors (one feature bitfield, the greedy flag and
the logprobs count per slot) decide which pipeline stages a batch needs without reading the
device. Tables for optional features (logit bias, allowed ids, stop ids, penalty counts) are
allocated when the first request that uses them arrives (bias.py, penalties.py).

The one per-step device update is ``post_update``: the output-token counts of the penalties.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mrv2.sampler.bias import LogitBiasState
from mrv2.sampler.penalties import PenaltyState
from mrv2.sampler.run_stops import RunStops
from mrv2.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from mrv2.state.requests import RequestState
from mrv2.state.staged import StagedWriteTensor

_SEED_MASK = (1 << 63) - 1

# Bits of SamplingStates.features_host: which optional stages a slot's request uses.
TOP_K = 1
TOP_P = 2
MIN_P = 4
LOGIT_BIAS = 8
ALLOWED = 16
MIN_TOKENS = 32
REPETITION = 64  # repetition_penalty != 1
FREQ_PRES = 128  # frequency_penalty or presence_penalty != 0
PENALTIES = REPETITION | FREQ_PRES


def request_seed(params: SamplingParams, engine_seed: int, req_id: str) -> int:
    """The request's own seed, or one derived from the engine seed and its id (stable across
    processes, unlike Python's `hash`)."""
    if params.seed is not None:
        return params.seed & _SEED_MASK
    # An odd 64-bit multiplier spreads every bit of the engine seed over the result.
    mixed = (engine_seed * 0x9E3779B97F4A7C15 + zlib.crc32(req_id.encode())) & _SEED_MASK
    return mixed


@dataclass(frozen=True)
class BatchFlags:
    """Which stages the rows of one batch use, from host mirrors only. Every ``any_*`` is a
    truthful superset (a min_tokens row stays flagged after it reached min_tokens); per-row
    "off" values inside an enabled stage are honoured on the device."""

    all_greedy: bool
    all_random: bool
    any_top_k: bool = False  # filters: random rows only (greedy rows ignore them)
    any_top_p: bool = False
    any_min_p: bool = False
    any_logit_bias: bool = False
    any_allowed: bool = False
    any_min_tokens: bool = False
    any_repetition: bool = False  # penalties: repetition
    any_freq_pres: bool = False  # penalties: frequency or presence
    max_num_logprobs: int = -1  # -1: no row asked for logprobs
    # > 0: every row with top-k or top-p has 0 < top_k <= max_top_k (a partial sort will do);
    # 0: some row has top-p without top-k (or no row filters).
    max_top_k: int = 0

    @property
    def any_filter(self) -> bool:
        return self.any_top_k or self.any_top_p or self.any_min_p

    @property
    def any_penalties(self) -> bool:
        return self.any_repetition or self.any_freq_pres

    @property
    def any_processing(self) -> bool:
        """Some stage before temperature changes the logits (it can change greedy tokens)."""
        return (self.any_logit_bias or self.any_allowed or self.any_min_tokens
                or self.any_penalties)


class _ScalarTable:
    """One per-slot scalar table: a contiguous view of the packed table (what kernels read)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _scalar_table(scalars: dict, num_slots: int, device: torch.device
                  ) -> tuple[StagedWriteTensor, dict[str, tuple[int, int, Tensor]]]:
    """A [1, words] int32 table holding every scalar table back to back (empty values set),
    and per name (offset in words, words per slot, its typed [num_slots] view)."""
    layout, offset = {}, 0
    for name, (dtype, _) in scalars.items():
        words = np.dtype(dtype).itemsize // 4
        offset += (-offset) % words  # an 8-byte table starts on an 8-byte boundary
        layout[name] = (offset, words)
        offset += words * num_slots
    host = np.zeros(offset, dtype=np.int32)
    for name, (dtype, empty) in scalars.items():
        start, words = layout[name]
        host[start:start + words * num_slots].view(dtype)[:] = empty
    table = torch.from_numpy(host).to(device).view(1, -1)
    columns = {}
    for name, (dtype, _) in scalars.items():
        start, words = layout[name]
        flat = table.view(-1)[start:start + words * num_slots]
        columns[name] = (start, words, flat.view(torch.from_numpy(np.zeros(0, dtype)).dtype))
    return StagedWriteTensor(table), columns


class SamplingStates:
    # Per-slot scalar tables: name -> (dtype, value of an empty slot).
    _SCALARS = {
        "temperature": (np.float32, 0.0),  # 0: greedy
        "top_k": (np.int32, 0),  # 0: off
        "top_p": (np.float32, 1.0),
        "min_p": (np.float32, 0.0),
        "seed": (np.int64, 0),
        "repetition_penalty": (np.float32, 1.0),
        "presence_penalty": (np.float32, 0.0),
        "frequency_penalty": (np.float32, 0.0),
        "min_tokens": (np.int32, 0),  # 0 also when the request has no stop id to mask
    }

    def __init__(self, requests: RequestState, vocab_size: int, engine_seed: int,
                 eos_token_ids: Sequence[int] = ()) -> None:
        # The slots' lengths (prompt_len for min_tokens, prefill_len for "did this row
        # sample") are read from their one owner, never copied here.
        self.requests = requests
        max_num_seqs, device = requests.max_num_seqs, requests.device
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.engine_seed = engine_seed
        self.device = device
        # The model's EOS ids (mrv2/models/generation_config.py): min_tokens masks every one.
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.run_stops = RunStops(max_num_seqs)  # where a run of decode steps may end
        # Each scalar table is a contiguous [max_num_seqs] device tensor (``self.<name>.tensor``)
        # with a host mirror (``self.<name>_host``). The tables are slices of one flat table
        # of 4-byte words, so a step's joining requests upload every table in one staged write
        # (one copy, one launch): ``add`` writes only the mirrors and remembers the slot.
        self._table, self._columns = _scalar_table(self._SCALARS, max_num_seqs, device)
        for name, (dtype, empty) in self._SCALARS.items():
            host = np.full(max_num_seqs, empty, dtype=dtype)
            setattr(self, f"{name}_host", host)
            setattr(self, name, _ScalarTable(self._columns[name][2]))
        self._dirty: list[int] = []
        self.bias = LogitBiasState(max_num_seqs, vocab_size, device)
        self.penalties = PenaltyState(max_num_seqs, vocab_size, device)
        self.greedy_host = np.ones(max_num_seqs, dtype=bool)
        self.features_host = np.zeros(max_num_seqs, dtype=np.uint8)
        self.num_logprobs_host = np.full(max_num_seqs, -1, dtype=np.int8)
        # The last batch's rows (as bytes) and their flags: a decode batch keeps its rows for
        # many steps, and the mirrors change only in `add`, which drops it.
        self._last_flags: tuple[bytes, BatchFlags] | None = None

    def add(self, slot: int, req_id: str, params: SamplingParams, prompt_token_ids,
            prefill_token_ids=None, *, eos_token_id: int | None = None,
            eos_stop_token_ids: Sequence[int] = ()) -> None:
        """Stage the slot's parameters for a new (or resumed) request.

        ``prefill_token_ids`` is the prompt plus the outputs produced before a preemption
        (defaults to the prompt); those outputs count for the penalties and min_tokens.
        ``eos_token_id`` is the request's primary EOS: min_tokens masks it with the model's
        EOS ids (it may be a tokenizer-only EOS the model's config does not name). With
        ``eos_stop_token_ids`` (its other EOS ids) it also makes the slot's `run_stops`.
        """
        if not 0 <= slot < self.max_num_seqs:
            raise IndexError(f"slot {slot} is outside [0, {self.max_num_seqs})")
        if prefill_token_ids is None:
            prefill_token_ids = prompt_token_ids
        prompt_len, prefill_len = len(prompt_token_ids), len(prefill_token_ids)
        vocab_size = self.vocab_size
        greedy = params.temperature < GREEDY_TEMPERATURE_EPS or params.top_k == 1
        # Greedy rows take the argmax path and ignore temperature and the filters.
        temperature = 0.0 if greedy else params.temperature
        # k >= vocab keeps every token: stored as 0 (off), which also keeps it within int32.
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        features = 0
        if not greedy:
            features |= ((TOP_K if 0 < top_k < vocab_size else 0)
                         | (TOP_P if params.top_p < 1.0 else 0)
                         | (MIN_P if params.min_p > 0.0 else 0))
        if params.logit_bias and any(0 <= t < vocab_size for t in params.logit_bias):
            features |= LOGIT_BIAS
        if params.allowed_token_ids is not None:
            features |= ALLOWED
        stop_ids: list[int] = []
        if params.min_tokens > 0 and prefill_len - prompt_len < params.min_tokens:
            stop_ids = list(params.stop_token_ids or ())
            if not params.ignore_eos:
                stop_ids.extend(self.eos_token_ids)
                if eos_token_id is not None:
                    stop_ids.append(eos_token_id)
            stop_ids = sorted({t for t in stop_ids if 0 <= t < vocab_size})
            if stop_ids:
                features |= MIN_TOKENS
        if params.repetition_penalty != 1.0:
            features |= REPETITION
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            features |= FREQ_PRES
        if features & PENALTIES:
            self.penalties.add(slot, prompt_token_ids, prefill_token_ids[prompt_len:])
        sparse = LOGIT_BIAS | ALLOWED | MIN_TOKENS
        if features & sparse or self.features_host[slot] & sparse:
            # Also when the slot's previous request used them: its lengths must be cleared.
            self.bias.add(slot, params.logit_bias, params.allowed_token_ids, stop_ids)

        self.temperature_host[slot] = temperature
        self.top_k_host[slot] = top_k
        self.top_p_host[slot] = params.top_p
        self.min_p_host[slot] = params.min_p
        self.seed_host[slot] = request_seed(params, self.engine_seed, req_id)
        self.repetition_penalty_host[slot] = params.repetition_penalty
        self.presence_penalty_host[slot] = params.presence_penalty
        self.frequency_penalty_host[slot] = params.frequency_penalty
        self.min_tokens_host[slot] = params.min_tokens if stop_ids else 0
        self._dirty.append(slot)
        self._last_flags = None
        self.greedy_host[slot] = greedy
        self.features_host[slot] = features
        self.num_logprobs_host[slot] = -1 if params.logprobs is None else params.logprobs
        self.run_stops.add(slot, params, eos_token_id, eos_stop_token_ids)

    def apply_staged_writes(self) -> None:
        if self._dirty:
            slots = np.unique(np.asarray(self._dirty, dtype=np.int64))
            self._dirty.clear()
            starts, lengths, values = [], [], []
            for name, (offset, words, _) in self._columns.items():
                host = getattr(self, f"{name}_host")
                starts.append(offset + slots * words)
                lengths.append(np.full(len(slots), words, dtype=np.int64))
                values.append(host[slots].view(np.int32))  # an 8-byte value: two words
            starts = np.concatenate(starts)
            self._table.stage_runs(np.zeros(len(starts), dtype=np.int64), starts,
                                   np.concatenate(lengths), np.concatenate(values))
            self._table.apply()
        self.bias.apply_staged_writes()
        self.penalties.apply_staged_writes()

    def batch_flags(self, idx_mapping_np: np.ndarray) -> BatchFlags:
        """The stages the batch of slots `idx_mapping_np` (int64) uses."""
        rows = np.ascontiguousarray(idx_mapping_np, dtype=np.int64).tobytes()
        last = self._last_flags
        if last is not None and last[0] == rows:
            return last[1]
        flags = self._batch_flags(idx_mapping_np)
        self._last_flags = (rows, flags)
        return flags

    def _batch_flags(self, idx_mapping_np: np.ndarray) -> BatchFlags:
        greedy = self.greedy_host[idx_mapping_np]
        row_features = self.features_host[idx_mapping_np]
        features = int(np.bitwise_or.reduce(row_features))
        logprobs = self.num_logprobs_host[idx_mapping_np]
        max_top_k = 0
        if features & TOP_K and not ((row_features & (TOP_K | TOP_P)) == TOP_P).any():
            max_top_k = int(self.top_k_host[idx_mapping_np][(row_features & TOP_K) != 0].max())
        return BatchFlags(
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            any_top_k=bool(features & TOP_K),
            any_top_p=bool(features & TOP_P),
            any_min_p=bool(features & MIN_P),
            any_logit_bias=bool(features & LOGIT_BIAS),
            any_allowed=bool(features & ALLOWED),
            any_min_tokens=bool(features & MIN_TOKENS),
            any_repetition=bool(features & REPETITION),
            any_freq_pres=bool(features & FREQ_PRES),
            max_num_logprobs=int(logprobs.max()) if len(logprobs) else -1,
            max_top_k=max_top_k,
        )

    def num_logprobs(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """Logprobs each batch row asked for (-1: none); for trimming the sampler's output."""
        return self.num_logprobs_host[idx_mapping_np]

    def uses_penalties(self, slots: np.ndarray) -> bool:
        """Whether a request in `slots` has a penalty."""
        return self.penalties.allocated and bool(
            np.bitwise_or.reduce(self.features_host[slots]) & PENALTIES)

    def post_update(self, idx_mapping: Tensor, idx_mapping_np: np.ndarray, positions: Tensor,
                    sampled: Tensor) -> None:
        """After sampling: count the sampled tokens for the penalties, on the device.

        ``positions`` are the positions of the sampled tokens (as passed to the sampler); a
        row whose prefill is still incomplete (position < prefill_len) produced no token. A
        slot may come more than once (the kept tokens of a verify step).
        Nothing runs unless a row of the batch uses penalties.
        """
        if not self.uses_penalties(idx_mapping_np):
            return
        did_sample = positions >= self.requests.prefill_len.tensor[idx_mapping]
        self.penalties.count_sampled(idx_mapping, sampled, did_sample)
