"""N-gram (prompt-lookup) draft proposer for speculative decoding: the torch reference.

Runs on any device, vectorised over rows, with no device-to-host sync; ngram_numba.py is its
CPU twin under the same name and gives identical results.

Semantics, per row r with slot s = slots[r] and context c = token_ids[s, :total_len[s]]
(n_tok tokens): for n from min(max_n, n_tok - 1) down to min_n, the suffix c[n_tok-n:] is
looked up at the latest start i with i + n < n_tok (an earlier occurrence whose continuation
exists); the first n with a match proposes k = min(K, max_drafts[r], n_tok - (i + n)) tokens
c[i+n : i+n+k]. No match (or max_drafts[r] <= 0) proposes nothing. drafts[r, k:] is 0.
"""

from __future__ import annotations

import torch


def propose_ngram(token_ids: torch.Tensor, slots: torch.Tensor, total_len: torch.Tensor,
                  min_n: int, max_n: int, max_drafts: torch.Tensor, drafts: torch.Tensor,
                  num_drafts: torch.Tensor) -> None:
    """Fill drafts [R, K] and num_drafts [R] with each row's n-gram proposal.

    token_ids [S, L]: per-slot token history; slots [R]: row -> slot; total_len [S]: tokens
    in each slot's history (<= L); max_drafts [R]: per-row cap on the proposal length.
    """
    ctx = token_ids.index_select(0, slots.long())  # [R, L]
    n_tok = total_len.index_select(0, slots.long()).long()  # [R]
    rows, seq = ctx.shape
    k_max = drafts.shape[1]
    device = ctx.device
    # Latest matching start and its n, per row; -1 / 0 until some n matched.
    best_start = torch.full((rows,), -1, dtype=torch.long, device=device)
    best_n = torch.zeros(rows, dtype=torch.long, device=device)
    # n <= n_tok - 1 <= L - 1, so larger n can never match: the loop stops at L - 1.
    for n in range(min(max_n, seq - 1), min_n - 1, -1):
        # Starts i with i + n < n_tok <= L lie in [0, L - n): `width` candidates per row.
        width = seq - n
        starts = torch.arange(width, device=device)
        # Clamped so rows too short for this n gather in bounds; they are masked below.
        suffix_idx = (n_tok[:, None] - n + torch.arange(n, device=device)).clamp(0, seq - 1)
        suffix = ctx.gather(1, suffix_idx)  # [R, n]
        windows = ctx.unfold(1, n, 1)[:, :width]  # [R, width, n], a view
        matched = (windows == suffix[:, None, :]).all(dim=-1)
        matched &= starts[None, :] + n < n_tok[:, None]
        matched &= (n <= n_tok - 1)[:, None]
        latest = torch.where(matched, starts[None, :], -1).amax(dim=1)  # [R]
        # Longest n first: a row keeps the first n that matched.
        take = (best_start < 0) & (latest >= 0)
        best_start = torch.where(take, latest, best_start)
        best_n = torch.where(take, n, best_n)
    found = best_start >= 0
    cont = best_start + best_n  # first continuation position; < n_tok where found
    k = torch.minimum(torch.minimum(n_tok - cont, max_drafts.long()),
                      torch.full_like(cont, k_max)).clamp(min=0)
    k = torch.where(found, k, 0)
    offs = torch.arange(k_max, device=device)
    cont_idx = (cont[:, None] + offs).clamp(0, seq - 1)
    vals = ctx.gather(1, cont_idx)
    drafts.copy_(torch.where(offs[None, :] < k[:, None], vals, 0))
    num_drafts.copy_(k)
