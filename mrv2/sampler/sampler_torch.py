"""The sampler's torch path (CPU): the pipeline of sampler.py on row tiles.

Tiles of ``TILE_ELEMS`` elements keep every ``[rows, V]`` intermediate (float32 copy, int64
hash state, sort) cache-resident and small enough for the allocator to reuse: on a 2-core
machine a fused pass over ~1M elements is several times faster than each op streaming the
whole batch. The loop is over tiles (B * V / TILE_ELEMS of them), never over rows.

Inside a tile a stage runs only on the rows that use it, picked from the host mirrors (the
feature bits, the greedy flag and the logprobs count of each row's slot): penalties and
allowed ids on their rows, temperature / filters / noise on the random rows, logprobs on the
rows that asked. A row's result never depends on which other rows share its tile or batch: every
op is elementwise or a per-row reduction, and the partial sort is exact (filters.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from mrv2.sampler import greedy_numba
from mrv2.sampler.bias import apply_allowed_, apply_logit_bias_, apply_min_tokens_
from mrv2.sampler.filters import apply_min_p_, apply_top_k_top_p_
from mrv2.sampler.logprobs import LogprobsTensors, compute_logprobs
from mrv2.sampler.noise import gumbel_noise
from mrv2.sampler.penalties import apply_penalties_
from mrv2.sampler.slot_tables import unpack_token_bits
from mrv2.sampler.states import (ALLOWED, LOGIT_BIAS, MIN_TOKENS, PENALTIES, BatchFlags,
                                 SamplingStates)

# Elements per row tile; tuned on a 2-core AVX2 machine, B=256, V=32000.
TILE_ELEMS = 1 << 20

RowSelection = slice | Tensor  # all rows of a tile, or the indices of some of them


@dataclass
class _RowParams:
    """Per-row inputs of a batch or tile: device tensors gathered once through idx_mapping,
    and host arrays from the mirrors (``*_np``)."""

    idx: Tensor
    positions: Tensor
    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    seed: Tensor
    greedy_np: np.ndarray
    features_np: np.ndarray
    num_logprobs_np: np.ndarray
    # Per row, the drafts its request's verify rows before it fed (speculative decoding: they
    # count as outputs for the penalties), -1 padded; [rows, 0] when no row has any.
    drafts_before: Tensor

    def __getitem__(self, rows: slice) -> "_RowParams":
        return _RowParams(**{name: getattr(self, name)[rows] for name in self.__dataclass_fields__})


def _select(mask: np.ndarray, device: torch.device) -> RowSelection | None:
    """The rows where ``mask`` holds: all of them as a slice, some as an index tensor, or
    None."""
    if mask.all():
        return slice(None)
    if not mask.any():
        return None
    return torch.from_numpy(np.flatnonzero(mask)).to(device)


def _on_rows(x: Tensor, rows: RowSelection, fn: Callable[[Tensor, RowSelection], None]) -> None:
    """Run the in-place stage ``fn(x_rows, rows)`` on some rows of ``x``."""
    if isinstance(rows, slice):
        fn(x, rows)
        return
    sub = x[rows]
    fn(sub, rows)
    x[rows] = sub


def sample_torch(logits: Tensor, idx_mapping: Tensor, idx_mapping_np: np.ndarray,
                 positions: Tensor, states: SamplingStates, flags: BatchFlags,
                 mode: str, drafts_before: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, LogprobsTensors | None]:
    """Sampled tokens [B] int64, the rows whose logits held a NaN ([B] bool; NaN is read as
    -inf) and the logprobs (None when no row asked for them)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    num_topk = flags.max_num_logprobs
    want_logprobs = num_topk >= 0
    processed = mode.startswith("processed")
    as_logits = mode.endswith("logits")
    tile = max(1, TILE_ELEMS // max(vocab_size, 1))
    num_logprobs_np = states.num_logprobs_host[idx_mapping_np]
    lp_out = None
    if want_logprobs:
        # Rows that asked for no logprobs keep zeros.
        lp_out = LogprobsTensors(
            torch.zeros(num_rows, 1 + num_topk, dtype=torch.int64, device=device),
            torch.zeros(num_rows, 1 + num_topk, dtype=torch.float32, device=device),
            torch.zeros(num_rows, dtype=torch.int64, device=device))

    def fill_logprobs(tile_rows: slice, source: Tensor, sampled: Tensor) -> None:
        assert lp_out is not None
        rows = _select(num_logprobs_np[tile_rows] >= 0, device)
        if rows is None:
            return
        part = compute_logprobs(source[rows], sampled[rows], num_topk, as_logits=as_logits)
        start = tile_rows.start
        out_rows = (slice(start, start + source.shape[0]) if isinstance(rows, slice)
                    else rows + start)
        lp_out.token_ids[out_rows] = part.token_ids
        lp_out.logprobs[out_rows] = part.logprobs
        lp_out.ranks[out_rows] = part.ranks

    if flags.all_greedy and not flags.any_processing and not (want_logprobs and processed):
        # Converting to float32 is exact and order-preserving, so the argmax (ties included)
        # equals the float32 copy's; skipping the copy saves a [B, V] pass.
        sampled, nan_rows = greedy_tokens(logits)
        if want_logprobs:
            for start in range(0, num_rows, tile):
                rows = slice(start, start + tile)
                fill_logprobs(rows, logits[rows], sampled[rows])
        return sampled, nan_rows, lp_out

    idx = idx_mapping.long()
    batch = _RowParams(idx=idx, positions=positions.long(),
                  temperature=states.temperature.tensor[idx], top_k=states.top_k.tensor[idx],
                  top_p=states.top_p.tensor[idx], min_p=states.min_p.tensor[idx],
                  seed=states.seed.tensor[idx], greedy_np=states.greedy_host[idx_mapping_np],
                  features_np=states.features_host[idx_mapping_np],
                  num_logprobs_np=num_logprobs_np,
                  drafts_before=(torch.empty(num_rows, 0, dtype=torch.int64, device=device)
                                 if drafts_before is None else drafts_before))
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    nan_rows = torch.zeros(num_rows, dtype=torch.bool, device=device)
    keep_processed = want_logprobs and processed
    for start in range(0, num_rows, tile):
        rows = slice(start, start + tile)
        source = logits[rows]
        x = source.to(torch.float32, copy=True)
        _mask_nan_(x, nan_rows[rows])
        params = batch[rows]
        if flags.any_processing:
            _process_tile_(x, params, states, flags)
        sampled = _sample_tile(x, params, flags, keep_processed=keep_processed)
        if want_logprobs:
            # With keep_processed, x holds each row's sampling distribution (no noise).
            fill_logprobs(rows, x if processed else source, sampled)
        out[rows] = sampled
    return out, nan_rows, lp_out


def greedy_tokens(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(argmax of each row, NaN read as -inf, ties to the lowest index; which rows held a
    NaN): greedy_numba's kernel on float32 CPU logits, else `greedy_argmax_torch`."""
    if greedy_numba.takes_logits(logits):
        return greedy_numba.greedy_argmax_float32(logits)
    return greedy_argmax_torch(logits)


def greedy_argmax_torch(logits: Tensor) -> tuple[Tensor, Tensor]:
    """`greedy_tokens` in torch ops: max(dim) gives argmax's indices (the first maximum; a
    NaN where the row holds one) in about a third of argmax's time on the CPU
    (bench/README.md); rows whose maximum is a NaN are redone with NaN as -inf."""
    best, sampled = logits.max(dim=-1)
    nan_rows = best.isnan()
    if nan_rows.any():  # a CPU tensor: no device sync
        rows = nan_rows.nonzero().squeeze(1)
        sampled[rows] = _nan_as_neg_inf(logits[rows]).argmax(dim=-1)
    return sampled, nan_rows


def _nan_as_neg_inf(x: Tensor) -> Tensor:
    return x.masked_fill(x.isnan(), float("-inf"))


def _mask_nan_(x: Tensor, nan_rows: Tensor) -> None:
    """NaN -> -inf in ``x``, in place, and the rows that held one flagged in ``nan_rows``."""
    # A row sum is NaN if the row holds a NaN (or both infinities): one cheap pass, and the
    # exact test only on those rows.
    suspect = x.sum(dim=1).isnan()
    if suspect.any():  # a CPU tensor: no device sync
        rows = suspect.nonzero().squeeze(1)
        sub = x[rows]
        nan_rows[rows] = sub.isnan().any(dim=1)
        x[rows] = _nan_as_neg_inf(sub)


def _process_tile_(x: Tensor, rows: _RowParams, states: SamplingStates, flags: BatchFlags) -> None:
    """Allowed ids, logit bias, min_tokens and penalties on one tile, in place; each stage on
    the rows whose request uses it."""
    idx, vocab_size, device = rows.idx, x.shape[1], x.device
    bias = states.bias
    feats = rows.features_np

    def stage(feature: int, fn: Callable[[Tensor, Tensor], None]) -> None:
        sel = _select((feats & feature) != 0, device)
        if sel is not None:
            _on_rows(x, sel, lambda sub, r: fn(sub, idx[r]))

    if flags.any_allowed:
        assert bias.allowed.words is not None
        stage(ALLOWED, lambda sub, slots: apply_allowed_(
            sub, bias.allowed.words[slots], bias.has_allowed.tensor[slots].bool()))
    if flags.any_logit_bias:
        assert bias.bias.ids is not None and bias.bias.values is not None
        stage(LOGIT_BIAS, lambda sub, slots: apply_logit_bias_(
            sub, bias.bias.ids[slots], bias.bias.values[slots], bias.bias.lengths.tensor[slots]))
    if flags.any_min_tokens:
        assert bias.stop_ids.ids is not None
        num_output = rows.positions - states.requests.prompt_len.tensor[idx]
        under = num_output < states.min_tokens.tensor[idx]
        sel = _select((feats & MIN_TOKENS) != 0, device)
        if sel is not None:
            _on_rows(x, sel, lambda sub, r: apply_min_tokens_(
                sub, bias.stop_ids.ids[idx[r]], bias.stop_ids.lengths.tensor[idx[r]], under[r]))
    if flags.any_penalties:
        pen = states.penalties
        assert pen.output_counts is not None and pen.prompt_mask.words is not None
        rep, freq_pres = flags.any_repetition, flags.any_freq_pres

        def penalise(sub: Tensor, r: RowSelection) -> None:
            slots, drafts = idx[r], rows.drafts_before[r]
            counts = pen.output_counts[slots]  # a gathered copy
            if drafts.shape[1]:
                counts.scatter_add_(1, drafts.clamp(min=0), (drafts >= 0).to(torch.int32))
            apply_penalties_(
                sub, counts,
                unpack_token_bits(pen.prompt_mask.words[slots], vocab_size) if rep else None,
                states.repetition_penalty.tensor[slots] if rep else None,
                states.presence_penalty.tensor[slots] if freq_pres else None,
                states.frequency_penalty.tensor[slots] if freq_pres else None)

        sel = _select((feats & PENALTIES) != 0, device)
        if sel is not None:
            _on_rows(x, sel, penalise)


def _sample_tile(x: Tensor, rows: _RowParams, flags: BatchFlags, *, keep_processed: bool) -> Tensor:
    """Greedy rows: argmax of the processed logits. Random rows: / temperature, filters, then
    Gumbel-max. With ``keep_processed``, ``x``'s random rows are left temperature-scaled and
    filtered (greedy rows: processed logits as they are), for processed logprobs."""
    if flags.all_greedy:
        return x.argmax(dim=-1)
    random = _select(~rows.greedy_np, x.device)
    if random is None:
        return x.argmax(dim=-1)
    sub = x if isinstance(random, slice) else x[random]
    sub.div_(rows.temperature[random].unsqueeze(1))
    if flags.any_min_p:
        apply_min_p_(sub, rows.min_p[random])
    if flags.any_top_k or flags.any_top_p:
        # One sort serves both; a stage no row uses is not computed at all.
        apply_top_k_top_p_(sub, rows.top_k[random] if flags.any_top_k else None,
                           rows.top_p[random] if flags.any_top_p else None,
                           max_top_k=flags.max_top_k)
    # Gumbel-max: -inf (filtered) + finite noise stays -inf, so dropped tokens never win.
    noisy = gumbel_noise(rows.seed[random], rows.positions[random], x.shape[-1]).add_(sub)
    if isinstance(random, slice):
        return noisy.argmax(dim=-1)
    if keep_processed:
        x[random] = sub
    # Greedy rows: argmax of their processed logits (ties -> lowest index).
    sampled = x.argmax(dim=-1) if keep_processed else torch.empty(
        x.shape[0], dtype=torch.int64, device=x.device)
    if not keep_processed:
        greedy = torch.from_numpy(np.flatnonzero(rows.greedy_np)).to(x.device)
        sampled[greedy] = x[greedy].argmax(dim=-1)
    sampled[random] = noisy.argmax(dim=-1)
    return sampled
