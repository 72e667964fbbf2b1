"""Per-row weighted radix select on float32 values: the threshold searches of top-k / top-p.

A float32 row is mapped to int32 keys whose signed order is the float order (``-0.0`` folded
into ``+0.0`` so that equal floats get equal keys, NaN read as ``-inf``). ``select_threshold``
then finds, per row, the largest key ``t`` with ``sum(weights[key >= t]) >= target`` in two
passes of 16-bit digits: each pass is one histogram (``scatter_add_`` into ``[rows, 2**16]``
bins, only the elements whose higher digits match the choice so far) and one suffix sum over
the bins. No sort, a fixed amount of work per row and nothing read back to the host.

With unit weights and ``target = k`` the key is the k-th largest value (top-k); with
``exp(x - max)`` weights and ``target = top_p * mass`` it is the smallest value of the smallest
top-p set (top-p). The answer is always a value of the row: the weight sum only changes at
keys that occur in it.
"""

from __future__ import annotations

import torch
from torch import Tensor

_DIGIT_BITS = 16
_NUM_BINS = 1 << _DIGIT_BITS
_HIGH_OFFSET = 1 << (_DIGIT_BITS - 1)  # arithmetic ``key >> 16`` lies in [-2**15, 2**15)
_LOW_MASK = _NUM_BINS - 1
_FLIP_LOW_31 = 0x7FFFFFFF  # negative floats: larger magnitude is smaller, so flip those bits


def sortable_keys(x: Tensor) -> Tensor:
    """int32 keys of float32 ``x``: ``a < b <=> key(a) < key(b)``, equal floats equal keys."""
    clean = torch.where(x.isnan(), float("-inf"), x).add_(0.0)  # -0.0 + 0.0 = +0.0
    bits = clean.view(torch.int32)
    return torch.where(bits < 0, bits ^ _FLIP_LOW_31, bits)


def keys_to_values(keys: Tensor) -> Tensor:
    """Inverse of ``sortable_keys`` (the bit flip is an involution that keeps the sign)."""
    return torch.where(keys < 0, keys ^ _FLIP_LOW_31, keys).view(torch.float32)


def _choose_digit(hist: Tensor, base: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The largest bin ``d`` with ``base + sum(hist[:, d:]) >= target`` (0 if none), and the
    weight above it, ``base + sum(hist[:, d + 1:])``."""
    # Suffix sums of non-negative weights never decrease towards bin 0, also when rounded.
    suffix = hist.flip(1).cumsum_(1).flip(1).add_(base.unsqueeze(1))
    digit = ((suffix >= target.unsqueeze(1)).sum(1) - 1).clamp_(min=0)
    above = torch.cat([suffix[:, 1:], base.unsqueeze(1)], dim=1).gather(
        1, digit.unsqueeze(1)).squeeze(1)
    return digit, above


def select_threshold(keys: Tensor, weights: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of ``keys`` [B, V] int32: the largest key ``t`` with
    ``sum(weights[keys >= t]) >= target`` ([B] int32; the smallest bin, i.e. below every key,
    when even the whole row falls short) and ``sum(weights[keys > t])`` ([B])."""
    rows = keys.shape[0]
    high = keys >> _DIGIT_BITS
    zero = torch.zeros(rows, dtype=weights.dtype, device=keys.device)
    hist = torch.zeros(rows, _NUM_BINS, dtype=weights.dtype, device=keys.device)
    hist.scatter_add_(1, (high + _HIGH_OFFSET).long(), weights)
    high_digit, above = _choose_digit(hist, zero, target)
    high_digit = high_digit - _HIGH_OFFSET
    # Elements outside the chosen high bin go to a spare bin that is dropped.
    low = torch.where(high == high_digit.unsqueeze(1), keys & _LOW_MASK, _NUM_BINS).long()
    hist = torch.zeros(rows, _NUM_BINS + 1, dtype=weights.dtype, device=keys.device)
    hist.scatter_add_(1, low, weights)
    low_digit, above = _choose_digit(hist[:, :_NUM_BINS], above, target)
    return (high_digit * _NUM_BINS + low_digit).to(torch.int32), above
