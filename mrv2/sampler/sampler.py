"""The torch sampler used by the runner's phase 2 (sample_tokens) on CPU.

Pipeline per row, on a float32 copy of the logits (the caller's tensor is never modified):

    temperature == 0  -> greedy: argmax of the raw logits (ties -> lowest index, as torch.argmax)
    otherwise         -> logits / temperature -> min-p -> top-k -> top-p
                         -> argmax(logits + gumbel(seed, position, token))

Gumbel-max sampling draws exactly from softmax(filtered logits), and the noise is a pure
function of (seed, position, token index) (see noise.py), so a seeded request samples the same
token whatever else is in the batch and wherever its row sits (DESIGN.md invariant 7).

The host passes ``any_*`` / ``all_*`` flags it already knows from the requests' sampling params,
so that stages no row uses are skipped without reading a device value back (invariant 4). The
flags must be truthful supersets: ``any_top_k=True`` when at least one row has top-k on, and so
on. Per-row "off" values (top_k 0/-1, top_p 1, min_p 0) are honoured inside an enabled stage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mrv2.sampler.filters import apply_min_p_, apply_top_k_top_p_
from mrv2.sampler.noise import gumbel_noise

# Elements per row tile (see Sampler.__call__); tuned on a 2-core AVX2 machine, B=256, V=32000.
TILE_ELEMS = 1 << 20


class Sampler:
    """Stateless: every per-request input arrives as a [B] tensor each step."""

    def __call__(
        self,
        logits: Tensor,
        temperature: Tensor,
        top_k: Tensor,
        top_p: Tensor,
        min_p: Tensor,
        seeds: Tensor,
        positions: Tensor,
        *,
        any_top_k: bool,
        any_top_p: bool,
        any_min_p: bool,
        all_greedy: bool,
        all_random: bool,
    ) -> Tensor:
        """Sample one token per row.

        Args:
            logits: [B, V], any float dtype.
            temperature: [B] float32; 0 means greedy.
            top_k: [B] int32; 0 or -1 disables.
            top_p: [B] float32; 1.0 disables.
            min_p: [B] float32; 0 disables.
            seeds: [B] int64, the request's sampling seed.
            positions: [B] int64, the position of the token being sampled.
            any_top_k / any_top_p / any_min_p: some row uses that filter.
            all_greedy / all_random: every row has temperature == 0 / > 0.

        Returns:
            [B] int64 token ids.
        """
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        if all_greedy:
            # Converting to float32 is exact and order-preserving, so the argmax (ties included)
            # equals the float32 copy's; skipping the copy saves a [B, V] pass.
            return logits.argmax(dim=-1)

        num_rows, vocab_size = logits.shape
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        # Row tiles keep every [rows, V] intermediate (float32 copy, int64 hash state, sort)
        # cache-resident and small enough for the allocator to reuse: on CPU a fused pass over
        # ~1M elements is several times faster than each op streaming the whole [B, V] batch.
        # This loops over tiles (B * V / TILE_ELEMS of them), not rows; each tile is vectorised.
        tile = max(1, TILE_ELEMS // max(vocab_size, 1))
        for start in range(0, num_rows, tile):
            rows = slice(start, start + tile)
            out[rows] = _sample_tile(
                logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows],
                seeds[rows], positions[rows], any_top_k=any_top_k, any_top_p=any_top_p,
                any_min_p=any_min_p, all_random=all_random,
            )
        return out


def _sample_tile(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    positions: Tensor,
    *,
    any_top_k: bool,
    any_top_p: bool,
    any_min_p: bool,
    all_random: bool,
) -> Tensor:
    """The sampler on a block of rows (see Sampler.__call__); rows never interact."""
    x = logits.to(torch.float32, copy=True)
    temperature = temperature.to(torch.float32)
    greedy_tokens: Tensor | None = None
    is_greedy: Tensor | None = None
    if all_random:
        scale = temperature
    else:
        is_greedy = temperature == 0.0
        # Taken before any scaling or filtering: greedy rows ignore every other parameter.
        greedy_tokens = x.argmax(dim=-1)
        # Greedy rows still flow through the vectorised random path (their result is discarded
        # below); a scale of 1 keeps them free of inf/nan from dividing by 0.
        scale = torch.where(is_greedy, 1.0, temperature)
    x.div_(scale.unsqueeze(1))

    if any_min_p:
        apply_min_p_(x, min_p)
    if any_top_k or any_top_p:
        # One sort serves both; a stage no row uses is not computed at all.
        apply_top_k_top_p_(
            x, top_k if any_top_k else None, top_p if any_top_p else None, skip_rows=is_greedy
        )

    # Gumbel-max: -inf (filtered) + finite noise stays -inf, so dropped tokens never win.
    x.add_(gumbel_noise(seeds, positions, x.shape[-1]))
    sampled = x.argmax(dim=-1)
    if greedy_tokens is not None and is_greedy is not None:
        sampled = torch.where(is_greedy, greedy_tokens, sampled)
    return sampled
