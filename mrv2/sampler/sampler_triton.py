"""The sampler's Triton path (CUDA; CPU tensors under ``triton_interpreter()`` in tests).

Same pipeline and results as the torch path in sampler.py, on the whole batch at once:

    float32 copy -> apply_bias_and_min_tokens_ -> apply_allowed_and_penalties_
    -> [filters in use or processed logprobs: / temperature, min-p, top-k/top-p in torch]
    -> gumbel_sample (temperature fused in when it was not applied above)
    -> logprobs pass over the raw logits or the processed copy

Every stage a batch does not use is skipped from the host flags.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrv2.sampler.bias_triton import apply_bias_and_min_tokens_
from mrv2.sampler.filters import apply_min_p_, apply_top_k_top_p_
from mrv2.sampler.logprobs import LogprobsTensors
from mrv2.sampler.logprobs_triton import compute_logprobs_triton
from mrv2.sampler.noise_triton import greedy_argmax, gumbel_sample
from mrv2.sampler.penalties_triton import apply_allowed_and_penalties_
from mrv2.sampler.states import BatchFlags, SamplingStates


def sample_triton(logits: Tensor, idx_mapping: Tensor, positions: Tensor,
                  states: SamplingStates, flags: BatchFlags,
                  mode: str) -> tuple[Tensor, Tensor, LogprobsTensors | None]:
    """Sampled tokens [B] int64, the rows whose logits held a NaN when sampled ([B] bool) and
    the logprobs (None when no row asked for them)."""
    num_topk = flags.max_num_logprobs
    want_logprobs = num_topk >= 0
    processed = mode.startswith("processed")
    positions = positions.long()
    if flags.all_greedy and not flags.any_processing and not (want_logprobs and processed):
        x = logits
        sampled, nan_rows = greedy_argmax(logits, idx_mapping)
    else:
        x = logits.to(torch.float32, copy=True)
        if flags.any_logit_bias or flags.any_min_tokens:
            apply_bias_and_min_tokens_(x, idx_mapping, positions, states,
                                       apply_bias=flags.any_logit_bias,
                                       apply_stop=flags.any_min_tokens)
        if flags.any_allowed or flags.any_penalties:
            apply_allowed_and_penalties_(x, idx_mapping, states, apply_allowed=flags.any_allowed,
                                         apply_penalties=flags.any_penalties)
        prescale = not flags.all_greedy and (flags.any_filter or (want_logprobs and processed))
        if prescale:
            _scale_and_filter_(x, idx_mapping, states, flags)
        sampled, nan_rows = gumbel_sample(x, idx_mapping, states.temperature.tensor, states.seed.tensor,
                                positions, apply_temperature=not prescale)
    logprobs = None
    if want_logprobs:
        source = x if processed else logits
        logprobs = compute_logprobs_triton(source, sampled, num_topk,
                                           as_logits=mode.endswith("logits"))
    return sampled, nan_rows, logprobs


def _scale_and_filter_(x: Tensor, idx_mapping: Tensor, states: SamplingStates,
                       flags: BatchFlags) -> None:
    """Temperature, min-p, top-k and top-p in torch; greedy rows are scaled by 1, unfiltered."""
    idx = idx_mapping.long()
    temperature = states.temperature.tensor[idx]
    is_greedy = None if flags.all_random else temperature == 0.0
    scale = temperature if is_greedy is None else torch.where(is_greedy, 1.0, temperature)
    x.div_(scale.unsqueeze(1))
    if flags.any_min_p:
        min_p = states.min_p.tensor[idx]
        apply_min_p_(x, min_p if is_greedy is None else torch.where(is_greedy, 0.0, min_p))
    if flags.any_top_k or flags.any_top_p:
        apply_top_k_top_p_(x, states.top_k.tensor[idx] if flags.any_top_k else None,
                           states.top_p.tensor[idx] if flags.any_top_p else None,
                           skip_rows=is_greedy, max_top_k=flags.max_top_k)
