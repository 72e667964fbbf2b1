"""SpecDecodeStats: the engine's speculative-decoding counters, as vLLM reports them
(`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`). Counted by the scheduler when a verify step's output
arrives; totals since the engine started."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # verify steps of a request with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # [i]: drafts accepted at position i of a verify step (its i + 1-th draft).
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step: `num_accepted` of its `num_draft_tokens` drafts kept
        (the first ones; drafts are accepted as a prefix)."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"{num_accepted} drafts accepted of {num_draft_tokens}")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1

    @property
    def totals(self) -> list[int]:
        """CoreStats.spec_decode: drafts, draft tokens, accepted tokens, accepted per position."""
        return [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                *self.num_accepted_tokens_per_pos]

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per draft token (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step yields on average: its accepted drafts plus the target's own
        token (vLLM's figure; 1.0 before any draft)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)
