"""Verification of drafted tokens (speculative decoding), the sampler's last stage.

A verify step feeds each request its last sampled token and its drafts d1..dk as k + 1 rows
(one token each), and the sampler samples every row as usual: row j's token is the one the
target samples at that position given the tokens before it. Draft d(j+1) is accepted while it
equals row j's sampled token; the request's new tokens are the sampled tokens of rows 0..a,
where a is the number of drafts accepted (the accepted drafts themselves, then the target's
own token at the first mismatch, or after the last draft).

Lossless, and more: Gumbel-max noise is keyed by (seed, position) (noise.py), so each row's
sampled token is the token the request would sample at that position without speculation,
and every accepted prefix equals that request's own output. A seeded request gives the same
tokens with and without drafts; for one-hot drafts (n-gram, suffix) the acceptance
probability is p(d), the standard rejection rule's, and a rejected position resamples from
p without d.

`verify_drafts` twins: this torch one (any device, no host sync) and rejection_numba's (CPU).
"""

from __future__ import annotations

import torch


def verify_drafts(sampled: torch.Tensor, input_ids: torch.Tensor, first_row: torch.Tensor,
                  num_rows: torch.Tensor, nan_rows: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request r, whose rows are first_row[r] .. first_row[r] + num_rows[r] - 1 (its
    drafts are the input ids of all but the first): (num_accepted [R] int32, final_rows [R]
    int64: the row of its last new token, first_row + num_accepted, nan [R] bool: a NaN in
    the logits of a row whose token it keeps). `sampled` [T] int64, `input_ids` [T]."""
    num_tokens, num_reqs = sampled.shape[0], first_row.shape[0]
    device = sampled.device
    first_row, num_rows = first_row.long(), num_rows.long()
    group = torch.repeat_interleave(torch.arange(num_reqs, device=device), num_rows,
                                    output_size=num_tokens)
    j = torch.arange(num_tokens, device=device) - first_row[group]
    match = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    match[:-1] = sampled[:-1] == input_ids[1:].to(sampled.dtype)
    # Row j verifies draft j + 1; a request's last row verifies nothing.
    ok = match & (j < num_rows[group] - 1)
    # The accepted drafts: the index of the first row that fails.
    fail = torch.where(ok, num_rows[group] - 1, j)
    num_accepted = torch.full((num_reqs,), 0, dtype=torch.int64, device=device)
    num_accepted = num_accepted.scatter_reduce(0, group, fail, "amin", include_self=False)
    kept = j <= num_accepted[group]
    nan = torch.zeros(num_reqs, dtype=torch.bool, device=device)
    nan = nan.index_put((group,), nan_rows & kept, accumulate=True)
    return num_accepted.int(), first_row + num_accepted, nan
