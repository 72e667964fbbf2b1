"""Logit filters for random sampling: min-p, top-k and top-p, on temperature-scaled logits.

Every function masks a float32 [B, V] tensor in place by writing ``-inf`` to dropped tokens, so a
dropped token can never win the Gumbel argmax. Each row is filtered independently with
vectorised ops (no Python loop over rows), and the per-row parameters are tensors that may live
on the device: nothing here reads a device value back to the host.

Disabled values are per row: ``min_p == 0``, ``top_k in (0, -1)`` (or >= V) and ``top_p >= 1``
leave a row untouched, so a batch that mixes filtered and unfiltered rows samples each row
exactly as it would alone.

Cut-offs are value thresholds, not positions in the sort: a token tied with the last kept value
is kept too. That makes the result independent of how ``torch.sort`` orders ties (it is not
stable), which batch invariance (DESIGN.md invariant 7) needs.
"""

from __future__ import annotations

import torch
from torch import Tensor


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


def apply_top_k_top_p_(
    x: Tensor, top_k: Tensor | None, top_p: Tensor | None, skip_rows: Tensor | None = None
) -> Tensor:
    """Top-k, then top-p on the renormalised survivors; in place. ``None`` skips a stage.

    One descending sort per call serves both stages: top-k's cut-off is the k-th largest value;
    top-p keeps the smallest prefix of the sorted tokens whose cumulative probability reaches
    ``top_p`` (the top token always survives, since the empty prefix sums to 0 < top_p).
    ``skip_rows`` ([B] bool, optional) marks rows whose result the caller discards (greedy rows).
    """
    if top_k is None and top_p is None:
        return x
    vocab_size = x.shape[-1]
    k = _effective_top_k(top_k, vocab_size) if top_k is not None else None

    # Rows with both stages off (or skipped) keep every token. The sort dominates this
    # function's cost, and a constant row sorts ~6x faster than a random one, so those rows
    # are sorted as zeros and get a -inf threshold below: same result, less work.
    filtered = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if k is not None:
        filtered |= k < vocab_size
    if top_p is not None:
        filtered |= top_p < 1.0
    if skip_rows is not None:
        filtered &= ~skip_rows
    sort_input = torch.where(filtered.unsqueeze(1), x, 0.0)
    # Only the values are needed: thresholds are compared against ``x`` in its own order.
    sorted_x = torch.sort(sort_input, dim=-1, descending=True).values

    if top_p is None:
        assert k is not None
        keep = k
    else:
        if k is not None:
            # Top-p sees the distribution renormalised over the top-k survivors.
            ranks = torch.arange(vocab_size, device=x.device)
            sorted_x.masked_fill_(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        cum = torch.softmax(sorted_x, dim=-1).cumsum_(dim=-1)
        p = top_p.to(torch.float32).unsqueeze(1)
        # cum is non-decreasing, so "#entries with cum < p" is the index of the first entry
        # that reaches p; keeping one more token gives the smallest prefix with mass >= p.
        keep = (cum < p).sum(dim=-1) + 1
        # top_p >= 1 keeps everything, even if float rounding makes cum reach 1.0 early and
        # would otherwise drop a tail of tiny-probability tokens.
        keep = torch.where(top_p >= 1.0, vocab_size, keep)
        if k is not None:
            # Tokens past k were masked above (probability 0); never count them as kept.
            keep = torch.minimum(keep, k)
        keep = keep.clamp_(max=vocab_size)

    # The smallest kept value; -inf when the kept prefix runs into already-masked tokens,
    # which then keeps every finite token (all of them were inside the prefix anyway).
    threshold = sorted_x.gather(1, (keep - 1).unsqueeze(1))
    threshold = torch.where(filtered.unsqueeze(1), threshold, float("-inf"))
    return x.masked_fill_(x < threshold, float("-inf"))
