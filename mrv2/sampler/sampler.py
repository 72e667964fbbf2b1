"""The sampler: runner phase 2's logits -> tokens (+ logprobs), Triton on CUDA, torch on CPU.

Pipeline per row, in place on a float32 copy of the logits (the caller's tensor is never
modified), each stage skipped when no row of the batch uses it (``BatchFlags``, decided on the
host from the states' mirrors, so nothing is read back from the device):

    allowed_token_ids (-inf elsewhere) -> logit_bias -> min_tokens (-inf on stop ids)
    -> repetition / frequency / presence penalties
    -> temperature == 0: greedy, argmax (ties -> lowest index, as torch.argmax)
       otherwise: / temperature -> min-p -> top-k -> top-p
                  -> argmax(logits + gumbel(seed, position, token))

Gumbel-max sampling draws exactly from softmax(filtered logits), and the noise is a pure
function of (seed, position, token index) (noise.py), so a seeded request samples the same
token whatever else is in the batch and wherever its row sits (DESIGN.md invariant 7). Every
per-row parameter is read from the per-slot tables through ``idx_mapping`` (states.py).

Logprobs (logprobs.py): the sampled token's and the top-k, raw by default or processed
(``logprobs_mode``), never through a ``[batch, vocab]`` log-softmax.

CPU: the torch pipeline on row tiles, each stage on the rows that use it (sampler_torch.py).
CUDA (or CPU under ``triton_interpreter()``): Triton kernels for the logits processing, the
temperature + Gumbel-max sampling and the logprobs pass (sampler_triton.py); the filters stay
in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from mrv2.config import check_logprobs_mode
from mrv2.sampler.logprobs import LogprobsTensors
from mrv2.sampler.sampler_torch import greedy_tokens, sample_torch
from mrv2.sampler.states import SamplingStates
from mrv2 import platform


@dataclass
class SamplerOutput:
    sampled: Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs
    # [B] bool, on the device: the row's logits held a NaN where it was sampled (after the
    # processing stages, which can mask one away). NaN never wins: the token is the argmax of
    # the other values (token 0 if all are NaN), so it is always in the vocabulary.
    nan_rows: Tensor


class Sampler:
    """Reads its parameters from ``states``; holds no per-request state of its own."""

    def __init__(self, states: SamplingStates, logprobs_mode: str = "raw_logprobs") -> None:
        check_logprobs_mode(logprobs_mode)
        self.states = states
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: Tensor, idx_mapping: Tensor, idx_mapping_np: np.ndarray,
                 positions: Tensor, drafts_before: Tensor | None = None) -> SamplerOutput:
        """Sample one token per batch row.

        Args:
            logits: [B, V], any float dtype.
            idx_mapping: [B] batch row -> slot (device); ``idx_mapping_np`` its host copy.
            positions: [B] int32 or int64, the position of the token being sampled (it keys
                the noise and counts the outputs so far for min_tokens).
            drafts_before: [B, k] int64, -1 padded: the drafts fed by the rows before each
                verify row of its request, outputs for the penalties (spec_decode/verify.py);
                the CPU's pipeline only.
        """
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        assert logits.shape[1] == self.states.vocab_size, (
            f"logits have {logits.shape[1]} columns, the states a vocabulary of "
            f"{self.states.vocab_size}")
        flags = self.states.batch_flags(idx_mapping_np)
        if platform.kernel_impl(logits.device) == platform.CPU:
            sampled, nan_rows, logprobs = sample_torch(logits, idx_mapping, idx_mapping_np,
                                                       positions, self.states, flags,
                                                       self.logprobs_mode, drafts_before)
        else:
            if drafts_before is not None:
                raise NotImplementedError("drafts counted for penalties: CPU sampler only")
            from mrv2.sampler.sampler_triton import sample_triton

            sampled, nan_rows, logprobs = sample_triton(logits, idx_mapping, positions,
                                                        self.states, flags, self.logprobs_mode)
        return SamplerOutput(sampled, logprobs, nan_rows)

    def argmax(self, logits: Tensor, idx_mapping: Tensor, idx_mapping_np: np.ndarray,
               positions: Tensor) -> SamplerOutput:
        """``__call__`` for a batch whose rows all decode by argmax (the caller checked their
        flags: greedy, no processing, no logprobs): on the CPU its greedy stage alone (the
        pipeline would reach the same kernel after its per-call bookkeeping), elsewhere the
        pipeline."""
        if platform.kernel_impl(logits.device) == platform.CPU:
            sampled, nan_rows = greedy_tokens(logits)
            return SamplerOutput(sampled, None, nan_rows)
        return self(logits, idx_mapping, idx_mapping_np, positions)
