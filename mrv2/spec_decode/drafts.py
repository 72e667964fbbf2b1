"""DraftState: the runner's per-slot speculative-decoding state, and its proposers.

After a step samples, `propose` drafts up to `num_speculative_tokens` tokens for each request
that samples and may draft, and writes them into the request's token history right after its
last token (RequestState.token_ids at total_len ..): the next step's input preparation reads
them there as the inputs of its verify rows (inputs/prepare.py), and an accepted draft is
already in place in the history. The counts and the drafts leave the runner
(ModelRunnerOutput.draft_token_ids, `written`); the scheduler schedules as many more tokens for
the request (fewer where its grammar rejects one).

Who drafts: a request whose tokens are each decided by its own position's logits and its
earlier tokens (sampler/rejection.py); a verify row's penalties count the drafts before it
(Speculator.drafts_before), and a grammar masks each verify row as of the drafts before it
(the scheduler keeps the drafts it accepts: core/structured_output.py). Prompt logprobs keep a
request on one token a step. Logprobs come with every kept token (each verify row's own).

Adaptive, per request (config.py's constants): the chance that its draft at each position is
kept (given the ones before it were) is estimated from its verify steps, and it drafts the
longest run whose last draft still pays for its row: the product of the chances up to it at
least the step's threshold (a row's measured time over a token's: the scheduler's,
core/draft_policy.py and step_cost.py), between 0 and num_speculative_tokens. One whose
chances pay for no draft stops drafting for a while (a backoff, doubled at each stop in a
row), then verifies one draft as a probe, so text that does not repeat costs almost nothing.
A lookup (ngram, suffix) that finds nothing pauses too, briefly (LOOKUP_MISS_MAX_PAUSE). Each
step's output tells the scheduler how many decode steps a request makes before it drafts again
(`written`'s pauses), which it runs as one run of decode steps (core/decode_steps.py).
`max_rows` keeps a step's verify rows within what the decode path takes in one call.
"""

from __future__ import annotations

import numpy as np

from mrv2.protocol import NEVER_DRAFTS
from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode import ngram_numba
from mrv2.spec_decode.config import (ACCEPT_DECAY, ACCEPT_PRIOR, ADAPTIVE_BACKOFF,
                                     ADAPTIVE_MAX_BACKOFF, LOOKUP_MISS_MAX_PAUSE,
                                     SpeculativeConfig)
from mrv2.spec_decode.draft_model import DraftModelProposer
from mrv2.spec_decode.eagle import EagleProposer, TargetStep
from mrv2.spec_decode.step_cost import DEFAULT_THRESHOLD, MAX_THRESHOLD, MIN_THRESHOLD
from mrv2.state.requests import RequestState

def may_draft(params: SamplingParams) -> bool:
    """Whether a request's tokens can be drafted and verified (see the module docstring)."""
    return params.prompt_logprobs is None


class DraftState:
    def __init__(self, config: SpeculativeConfig, requests: RequestState,
                 draft_model: DraftModelProposer | None = None,
                 eagle: EagleProposer | None = None) -> None:
        self.config = config
        self.draft_model = draft_model  # method "draft_model": its proposer
        self.eagle = eagle  # method "eagle" or "eagle3": its proposer
        self.requests = requests
        slots = requests.max_num_seqs
        self.may_draft_host = np.zeros(slots, dtype=np.bool_)
        k = config.num_speculative_tokens
        # Per draft position, decayed counts (ACCEPT_DECAY) of drafts kept and rejected there,
        # each given that the drafts before it were kept.
        self.kept_host = np.zeros((slots, k), dtype=np.float32)
        self.rejected_host = np.zeros((slots, k), dtype=np.float32)
        # Decode steps left without drafts, as of the last proposal (a backoff or a miss).
        self.backoff_host = np.zeros(slots, dtype=np.int32)
        self.next_backoff_host = np.full(slots, ADAPTIVE_BACKOFF, dtype=np.int32)
        self.miss_pause_host = np.ones(slots, dtype=np.int32)  # the pause of its next miss
        self.probe_host = np.zeros(slots, dtype=np.bool_)  # one draft after its backoff
        # The chance a draft needs to pay for its row, the scheduler's for this step
        # (core/draft_policy.py, Speculator.begin_step).
        self.threshold = DEFAULT_THRESHOLD
        self._drafts = np.zeros((slots, k), dtype=np.int32)
        self._num_drafts = np.zeros(slots, dtype=np.int32)
        self.suffix = None
        if config.method == "suffix":
            from mrv2.spec_decode.suffix import SuffixProposer

            self.suffix = SuffixProposer(
                slots, k, max_tree_depth=config.suffix_decoding_max_tree_depth,
                max_cached_requests=config.suffix_decoding_max_cached_requests,
                max_spec_factor=config.suffix_decoding_max_spec_factor,
                min_token_prob=config.suffix_decoding_min_token_prob)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def add(self, slot: int, params: SamplingParams) -> None:
        self.may_draft_host[slot] = may_draft(params)
        self.kept_host[slot] = self.rejected_host[slot] = self.backoff_host[slot] = 0
        self.next_backoff_host[slot] = ADAPTIVE_BACKOFF
        self.miss_pause_host[slot] = 1
        self.probe_host[slot] = False
        if self.suffix is not None:
            self.suffix.start(slot)
        if self.draft_model is not None:
            self.draft_model.start(slot)

    def finish(self, slot: int) -> None:
        """The request in `slot` ended (finished or preempted): its outputs join the suffix
        proposer's tree of earlier requests."""
        if self.suffix is not None and self.may_draft_host[slot]:
            requests = self.requests
            total = int(requests.total_len.numpy[slot])
            prompt = int(requests.prompt_len_host[slot])
            self.suffix.finish(slot, requests.token_ids.numpy[slot, :total].copy(), prompt)
        self.may_draft_host[slot] = False

    def record_verified(self, slots: np.ndarray, num_drafts: np.ndarray,
                        num_accepted: np.ndarray) -> None:
        """Verify steps' results (slots of requests that verified drafts): the counts of the
        positions each tried (its kept drafts and the first rejected one); a kept draft brings
        the next backoff back to its shortest."""
        cols = np.arange(self.num_speculative_tokens)[None, :]
        tried = cols < np.minimum(num_accepted + 1, num_drafts)[:, None]
        kept = cols < num_accepted[:, None]
        for counts, hit in ((self.kept_host, kept), (self.rejected_host, tried & ~kept)):
            old = counts[slots]
            counts[slots] = np.where(tried, ACCEPT_DECAY * old + hit, old)
        self.next_backoff_host[slots[num_accepted > 0]] = ADAPTIVE_BACKOFF
        self.probe_host[slots] = False

    def _limits(self, slots: np.ndarray, max_rows: int | None, steps: int, num_rows: int
                ) -> tuple[np.ndarray, np.ndarray]:
        """(whether each request drafts now; the most drafts it may propose), its backoff
        advanced by `steps` (a request that stops drafting here starts one). With `max_rows`,
        the drafts of `num_rows` requests and a row each for their tokens fit in that many."""
        requests = self.requests
        backoff = np.maximum(self.backoff_host[slots] - steps, 0)  # `steps` of it have run
        self.backoff_host[slots] = backoff
        kept = self.kept_host[slots] + ACCEPT_PRIOR[0]
        chance = kept / (kept + self.rejected_host[slots] + ACCEPT_PRIOR[1])  # [n, k]
        threshold = min(max(self.threshold, MIN_THRESHOLD), MAX_THRESHOLD)
        # The longest run whose last draft still pays: the chance that it and every draft
        # before it are kept, at least the threshold (a product falling with the length).
        length = (np.cumprod(chance, axis=1) >= threshold).sum(axis=1)
        active = self.may_draft_host[slots] & (backoff == 0)
        probe = active & self.probe_host[slots]
        # A probe is proposed until one is verified (record_verified): a lookup that finds
        # nothing does not spend it.
        length = np.where(probe, np.maximum(length, 1), length).astype(np.int32)
        stop = slots[active & (length == 0)]
        if len(stop):
            pause = self.next_backoff_host[stop]
            self.backoff_host[stop] = pause  # the next step is the pause's first
            self.next_backoff_host[stop] = np.minimum(2 * pause, ADAPTIVE_MAX_BACKOFF)
            self.probe_host[stop] = True
        drafting = active & (length > 0)
        room = requests.max_model_len - 1 - requests.total_len.numpy[slots]  # in the history
        if max_rows is not None:
            length = np.minimum(length, max(0, max_rows // max(1, num_rows) - 1))
        return drafting, np.where(drafting, np.minimum(room, length), 0).astype(np.int32)

    def propose_from_hidden(self, slots: np.ndarray, is_sampling: np.ndarray,
                            max_rows: int | None, step: TargetStep, steps: int = 1
                            ) -> np.ndarray:
        """EAGLE: every request of the step (`slots`, batch order; those `is_sampling` just
        sampled) catches up on `step`'s hidden states where it may draft and is not backing
        off; those that sampled draft. Their counts (int32, 0 where not sampling). `steps`:
        as `propose`'s (a multi-step run's: the head catches up on its last position only)."""
        drafting, max_drafts = self._limits(slots, max_rows, steps, int(is_sampling.sum()))
        return self.eagle.propose(slots, drafting, np.where(is_sampling, max_drafts, 0), step)

    def written(self, slots: np.ndarray, num_drafts: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """What the step's output carries: (`num_drafts`, the drafts themselves: each
        request's, flat, in order, read where the proposers wrote them, after each history;
        the decode steps each request makes before it may draft again: its pause, 0 where it
        looks after its next step, NEVER_DRAFTS where it never drafts)."""
        cols = np.arange(int(num_drafts.max(initial=0)))
        keep = cols[None, :] < num_drafts[:, None]
        starts = self.requests.total_len.numpy[slots]
        pauses = np.where(self.may_draft_host[slots], self.backoff_host[slots], NEVER_DRAFTS)
        return num_drafts, self.requests.token_ids.numpy[
            np.broadcast_to(slots[:, None], keep.shape)[keep],
            (starts[:, None] + cols)[keep]], pauses.astype(np.int32)

    def _pause_misses(self, slots: np.ndarray, looked: np.ndarray, found: np.ndarray) -> None:
        """Requests whose lookup found nothing pause (their miss pause, doubled for the next
        miss up to LOOKUP_MISS_MAX_PAUSE); one that found drafts starts again from 1."""
        missed = slots[looked & ~found]
        pause = self.miss_pause_host[missed]
        self.backoff_host[missed] = pause
        self.miss_pause_host[missed] = np.minimum(2 * pause, LOOKUP_MISS_MAX_PAUSE)
        self.miss_pause_host[slots[found]] = 1

    def propose(self, slots: np.ndarray, max_rows: int | None = None, steps: int = 1
                ) -> np.ndarray:
        """Drafts for the requests in `slots` (int64; each has just sampled: its history ends
        with its new token), written after their history; returns their counts (int32). With
        `max_rows`, the drafts of all and a row each for their tokens fit in that many rows.
        `steps`: the decode steps since the last proposal (a multi-step run's), off a backoff."""
        if self.eagle is not None:
            raise RuntimeError("an EAGLE head drafts from the step's hidden states: "
                               "propose_from_hidden")
        requests = self.requests
        token_ids, total_len = requests.token_ids.numpy, requests.total_len.numpy
        max_drafts = self._limits(slots, max_rows, steps, len(slots))[1]
        rows = len(slots)
        drafts, num_drafts = self._drafts[:rows], self._num_drafts[:rows]
        if self.draft_model is not None:  # it writes its drafts after the history itself
            return self.draft_model.propose(slots, max_drafts)
        if not max_drafts.any():
            num_drafts[:] = 0
            return num_drafts.copy()
        if self.suffix is not None:
            self.suffix.propose(slots, token_ids, total_len, max_drafts, drafts, num_drafts)
        else:
            ngram_numba.propose_ngram(token_ids, slots, total_len,
                                      self.config.prompt_lookup_min,
                                      self.config.prompt_lookup_max, max_drafts, drafts,
                                      num_drafts)
        self._pause_misses(slots, max_drafts > 0, num_drafts > 0)
        # Each row's drafts after its history, in one scatter.
        cols = np.arange(drafts.shape[1])
        keep = cols[None, :] < num_drafts[:, None]
        row_of = np.broadcast_to(slots[:, None], keep.shape)[keep]
        token_ids[row_of, (total_len[slots][:, None] + cols[None, :])[keep]] = drafts[keep]
        return num_drafts.copy()
