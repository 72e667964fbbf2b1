"""Logit filters for random sampling: min-p, top-k and top-p, on temperature-scaled logits.

Every function masks a float32 [B, V] tensor in place by writing ``-inf`` to dropped tokens, so a
dropped token can never win the Gumbel argmax. Each row is filtered independently with
vectorised ops (no Python loop over rows), and the per-row parameters are tensors that may live
on the device: nothing here reads a device value back to the host.

Disabled values are per row: ``min_p == 0``, ``top_k in (0, -1)`` (or >= V) and ``top_p >= 1``
leave a row untouched, so a batch that mixes filtered and unfiltered rows samples each row
exactly as it would alone.

Cut-offs are value thresholds, not positions in the sort: a token tied with the last kept value
is kept too. That makes the result independent of how ties are ordered, which batch invariance
(DESIGN.md invariant 7) needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrv2.sampler.radix_select import keys_to_values, select_threshold, sortable_keys


def apply_min_p_(x: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below ``min_p * max probability``; in place.

    prob_i < min_p * prob_max  <=>  x_i < x_max + log(min_p), so no softmax is needed, and
    ``log(0) = -inf`` makes ``min_p == 0`` keep every token.
    """
    threshold = x.amax(dim=-1, keepdim=True) + min_p.to(x.dtype).log().unsqueeze(1)
    return x.masked_fill_(x < threshold, float("-inf"))


def _effective_top_k(top_k: Tensor, vocab_size: int) -> Tensor:
    """top_k as int64 with "off" (0, -1) and anything above V mapped to V."""
    k = top_k.to(torch.int64)
    return torch.where((k <= 0) | (k > vocab_size), vocab_size, k)


# Above this many columns a partial sort (topk) stops paying off against the threshold search.
MAX_PARTIAL_SORT = 1024
# Below this vocabulary the search's 2**16-bin histograms outweigh the row and a full sort is
# faster on the CPU; on a CUDA GPU torch's segmented sort is faster at every vocabulary
# measured (bench/test_sampler.py::test_sampler_filters, figures in bench/README.md).
MIN_SEARCH_VOCAB = 1 << 17


def apply_top_k_top_p_(
    x: Tensor, top_k: Tensor | None, top_p: Tensor | None, skip_rows: Tensor | None = None,
    max_top_k: int = 0,
) -> Tensor:
    """Top-k, then top-p on the renormalised survivors; in place. ``None`` skips a stage.

    Both stages end in one value threshold per row (``x < threshold`` -> ``-inf``): top-k's is
    the k-th largest value; top-p's the smallest value of the smallest set of top tokens whose
    probability (renormalised over the top-k survivors) reaches ``top_p`` (the top token always
    survives). ``skip_rows`` ([B] bool, optional) marks rows whose result the caller discards
    (greedy rows): they and rows with both stages off keep every token.

    ``max_top_k`` > 0 promises that every filtered row has ``0 < top_k <= max_top_k`` (the host
    knows it from its mirrors): a small bound takes the top ``max_top_k`` values with
    torch.topk, which is all both stages read. Otherwise the thresholds come from a radix
    select over the whole row (radix_select.py) on large vocabularies on the CPU, a full sort
    on small ones and on a GPU (where it is faster).
    """
    if top_k is None and top_p is None:
        return x
    vocab_size = x.shape[-1]
    k = _effective_top_k(top_k, vocab_size) if top_k is not None else None
    filtered = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if k is not None:
        filtered |= k < vocab_size
    if top_p is not None:
        filtered |= top_p < 1.0
    if skip_rows is not None:
        filtered &= ~skip_rows
    if k is not None and 0 < max_top_k < min(vocab_size, MAX_PARTIAL_SORT + 1):
        threshold = _partial_sort_threshold(x, k, top_p, filtered, max_top_k)
    elif vocab_size < MIN_SEARCH_VOCAB or x.is_cuda:
        threshold = _partial_sort_threshold(
            x, k if k is not None else torch.full_like(filtered, vocab_size, dtype=torch.int64),
            top_p, filtered, vocab_size)
    else:
        threshold = _searched_threshold(x, k, top_p)
    threshold = torch.where(filtered, threshold, float("-inf"))
    return x.masked_fill_(x < threshold.unsqueeze(1), float("-inf"))


def _searched_threshold(x: Tensor, k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """[B] thresholds by radix select; the same values as the sort-based rule (see
    ``_partial_sort_threshold``) except where a row's top-p mass lands on ``top_p`` within float
    rounding (the sums run in another order)."""
    keys = sortable_keys(x)
    rows = x.shape[0]
    ones = None
    if k is not None:
        ones = torch.ones(rows, x.shape[1], dtype=torch.float32, device=x.device)
        key_k, num_above_k = select_threshold(keys, ones, k.to(torch.float32))
        threshold = keys_to_values(key_k)
        if top_p is None:
            return threshold
    assert top_p is not None
    max_key = keys.amax(dim=1)
    row_max = keys_to_values(max_key)
    row_max = torch.where(row_max.isfinite(), row_max, 0.0)
    mass = keys_to_values(keys).sub_(row_max.unsqueeze(1)).exp_()  # NaN read as -inf: 0
    if k is None:
        total = mass.sum(dim=1)
    else:
        # The top-k survivors by position: everything above the k-th value, plus as many of
        # the tokens tied with it as fit in k.
        above = mass.masked_fill(keys <= key_k.unsqueeze(1), 0.0).sum(dim=1)
        tied = k.to(torch.float32) - num_above_k
        total = above + tied * (threshold - row_max).exp()
    key_p, _ = select_threshold(keys, mass, top_p.to(torch.float32) * total)
    # top_p == 0 would select above the row maximum; the top token always survives.
    threshold_p = keys_to_values(torch.minimum(key_p, max_key))
    threshold_p = torch.where(top_p >= 1.0, float("-inf"), threshold_p)
    return threshold_p if k is None else torch.maximum(threshold, threshold_p)


def _partial_sort_threshold(x: Tensor, k: Tensor, top_p: Tensor | None, filtered: Tensor,
                            max_top_k: int) -> Tensor:
    """[B] thresholds from the top ``max_top_k`` sorted values (all of them: a full sort).

    The result is bit-for-bit the full sort's, so a row does not depend on the batch that
    decided ``max_top_k``: the sorted prefix is the same values, past a row's k everything is
    -inf, and the top-p sums below are elementwise ops plus a sequential scan on CPU.
    """
    # Rows that are not filtered sort as zeros (a constant row sorts faster): their threshold
    # is replaced by -inf anyway.
    sort_input = torch.where(filtered.unsqueeze(1), x, 0.0)
    if max_top_k < x.shape[1]:
        sorted_x = torch.topk(sort_input, max_top_k, dim=-1, sorted=True).values
    else:
        sorted_x = torch.sort(sort_input, dim=-1, descending=True).values
    k = torch.clamp(k, max=max_top_k)  # rows that are not filtered: k = V -> max_top_k
    width = max_top_k
    if top_p is None:
        keep = k
    else:
        # Top-p sees the distribution renormalised over the top-k survivors.
        ranks = torch.arange(width, device=x.device)
        sorted_x.masked_fill_(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        # Unnormalised probabilities relative to the row maximum, then their running sum.
        cum = sorted_x.sub(sorted_x[:, :1]).exp_().cumsum_(dim=-1)
        p = top_p.to(torch.float32).unsqueeze(1) * cum[:, -1:]
        # cum is non-decreasing, so "#entries with cum < p * total" is the index of the first
        # entry that reaches p; keeping one more token gives the smallest prefix with mass >= p.
        keep = (cum < p).sum(dim=-1) + 1
        # top_p >= 1 keeps everything, even if float rounding makes cum reach 1.0 early.
        keep = torch.where(top_p >= 1.0, width, keep)
        keep = torch.minimum(keep, k).clamp_(max=width)
    # The smallest kept value; -inf when the kept prefix runs into already-masked tokens,
    # which then keeps every finite token (all of them were inside the prefix anyway).
    return sorted_x.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)
