"""The top-k / top-p filter as it was before the threshold search: one full descending sort
(or a torch.topk when ``max_top_k`` bounds k). Kept as the reference that
mrv2/sampler/filters.py must match token for token (tests, and the old-vs-new benchmark)."""

from __future__ import annotations

import torch
from torch import Tensor

def _effective_top_k(top_k: Tensor, vocab_size: int) -> Tensor:
    """top_k as int64 with "off" (0, -1) and anything above V mapped to V."""
    k = top_k.to(torch.int64)
    return torch.where((k <= 0) | (k > vocab_size), vocab_size, k)


# Above this many columns a partial sort (topk) stops paying off against a full sort.
MAX_PARTIAL_SORT = 1024


def reference_top_k_top_p_(
    x: Tensor, top_k: Tensor | None, top_p: Tensor | None, skip_rows: Tensor | None = None,
    max_top_k: int = 0,
) -> Tensor:
    """Top-k, then top-p on the renormalised survivors; in place. ``None`` skips a stage.

    One descending sort per call serves both stages: top-k's cut-off is the k-th largest value;
    top-p keeps the smallest prefix of the sorted tokens whose cumulative probability reaches
    ``top_p`` (the top token always survives, since the empty prefix sums to 0 < top_p).
    ``skip_rows`` ([B] bool, optional) marks rows whose result the caller discards (greedy rows).

    ``max_top_k`` > 0 promises that every filtered row has ``0 < top_k <= max_top_k`` (the host
    knows it from its mirrors): then only the top ``max_top_k`` values are sorted (torch.topk),
    which is all both stages read. The result is bit-for-bit the full sort's, so a row does not
    depend on the batch that decided ``max_top_k``: the sorted prefix is the same values, past a
    row's k everything is -inf, and the top-p sums below are elementwise ops plus a sequential
    scan on CPU (the torch path; the Triton path, whose GPU scans are parallel, always sorts
    fully).
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
    if k is not None and 0 < max_top_k < min(vocab_size, MAX_PARTIAL_SORT + 1):
        sorted_x = torch.topk(sort_input, max_top_k, dim=-1, sorted=True).values
        k = torch.clamp(k, max=max_top_k)  # rows that are not filtered: k = V -> max_top_k
    else:
        sorted_x = torch.sort(sort_input, dim=-1, descending=True).values
    width = sorted_x.shape[1]

    if top_p is None:
        assert k is not None
        keep = k
    else:
        if k is not None:
            # Top-p sees the distribution renormalised over the top-k survivors.
            ranks = torch.arange(width, device=x.device)
            sorted_x.masked_fill_(ranks.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        # Unnormalised probabilities relative to the row maximum (the first sorted value),
        # then their running sum: elementwise ops and a per-row scan, so a token's partial sum
        # is the same however many (-inf, so zero) columns follow it.
        cum = sorted_x.sub(sorted_x[:, :1]).exp_().cumsum_(dim=-1)
        p = top_p.to(torch.float32).unsqueeze(1) * cum[:, -1:]
        # cum is non-decreasing, so "#entries with cum < p * total" is the index of the first
        # entry that reaches p; keeping one more token gives the smallest prefix with mass >= p.
        keep = (cum < p).sum(dim=-1) + 1
        # top_p >= 1 keeps everything, even if float rounding makes cum reach 1.0 early and
        # would otherwise drop a tail of tiny-probability tokens.
        keep = torch.where(top_p >= 1.0, width, keep)
        if k is not None:
            # Tokens past k were masked above (probability 0); never count them as kept.
            keep = torch.minimum(keep, k)
        keep = keep.clamp_(max=width)

    # The smallest kept value; -inf when the kept prefix runs into already-masked tokens,
    # which then keeps every finite token (all of them were inside the prefix anyway).
    threshold = sorted_x.gather(1, (keep - 1).unsqueeze(1))
    threshold = torch.where(filtered.unsqueeze(1), threshold, float("-inf"))
    return x.masked_fill_(x < threshold, float("-inf"))
