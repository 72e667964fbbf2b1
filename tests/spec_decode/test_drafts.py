"""DraftState: who drafts, drafts written after the history, adaptive backoff."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode.config import ADAPTIVE_BACKOFF, ADAPTIVE_WINDOW, SpeculativeConfig
from mrv2.spec_decode.drafts import DraftState, may_draft
from mrv2.state.requests import RequestState

PERIODIC = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # proposes 7 8 5 6 ...


def state(method: str = "ngram", k: int = 3, max_model_len: int = 32):
    requests = RequestState(4, max_model_len, torch.device("cpu"))
    extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
    config = SpeculativeConfig.from_value({"method": method, "num_speculative_tokens": k,
                                           **extra})
    return requests, DraftState(config, requests)


def add(requests, drafts, tokens, params=SamplingParams(temperature=0.0)) -> int:
    slot = requests.add(f"r{requests.num_active}", len(tokens), tokens, len(tokens))
    requests.apply_staged_writes()
    drafts.add(slot, params)
    return slot


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.7, top_k=5, seed=3, logit_bias={1: 1.0}), True),
    (SamplingParams(repetition_penalty=1.2), True),
    (SamplingParams(presence_penalty=0.5), True),
    (SamplingParams(logprobs=2), True),
    (SamplingParams(prompt_logprobs=1), False),
])
def test_may_draft(params, expected):
    assert may_draft(params) is expected


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_follow_the_history(method):
    requests, drafts = state(method)
    slot = add(requests, drafts, PERIODIC)
    num = drafts.propose(np.array([slot]))
    assert num.tolist() == [3]
    total = int(requests.total_len.numpy[slot])
    assert requests.token_ids.numpy[slot, total:total + 3].tolist() == [7, 8, 5]


def test_no_drafts_for_a_request_that_may_not():
    requests, drafts = state()
    slot = add(requests, drafts, PERIODIC, SamplingParams(prompt_logprobs=1))
    assert drafts.propose(np.array([slot])).tolist() == [0]


def test_drafts_stay_within_max_model_len():
    requests, drafts = state(max_model_len=len(PERIODIC) + 2)
    slot = add(requests, drafts, PERIODIC)
    # total_len = 10 of 12: one draft fits before the last position.
    assert drafts.propose(np.array([slot])).tolist() == [1]


def test_draft_length_follows_acceptance():
    requests, drafts = state(k=4)
    slot = add(requests, drafts, PERIODIC)
    slots = np.array([slot])
    assert drafts.propose(slots).tolist() == [4]
    drafts.record_verified(slots, np.array([4]), np.array([2]))  # not all: one fewer
    assert drafts.propose(slots).tolist() == [3]
    drafts.record_verified(slots, np.array([3]), np.array([1]))
    drafts.record_verified(slots, np.array([2]), np.array([1]))
    assert drafts.propose(slots).tolist() == [1]  # never below one
    drafts.record_verified(slots, np.array([1]), np.array([1]))  # all: two more
    assert drafts.propose(slots).tolist() == [3]


def test_max_rows_shares_a_steps_rows():
    requests, drafts = state(k=4)
    slots = np.array([add(requests, drafts, PERIODIC) for _ in range(3)])
    # 3 requests in 8 rows: 2 rows each, one for the sampled token and one draft
    assert drafts.propose(slots, max_rows=8).tolist() == [1, 1, 1]
    assert drafts.propose(slots, max_rows=3).tolist() == [0, 0, 0]


def test_backoff_after_misses():
    requests, drafts = state()
    slot = add(requests, drafts, PERIODIC)
    slots = np.array([slot])
    for _ in range(ADAPTIVE_WINDOW - 1):
        drafts.record_verified(slots, np.array([3]), np.array([0]))
    drafts.record_verified(slots, np.array([1]), np.array([1]))  # an accepted draft resets
    assert drafts.propose(slots).tolist() == [3]
    for _ in range(ADAPTIVE_WINDOW):
        drafts.record_verified(slots, np.array([1]), np.array([0]))
    for _ in range(ADAPTIVE_BACKOFF):
        assert drafts.propose(slots).tolist() == [0]
    assert drafts.propose(slots).tolist() == [1]
    # Stops in a row double the pause; an accepted draft brings it back.
    for pause in (2 * ADAPTIVE_BACKOFF, 4 * ADAPTIVE_BACKOFF, ADAPTIVE_BACKOFF):
        if pause == ADAPTIVE_BACKOFF:
            drafts.record_verified(slots, np.array([1]), np.array([1]))
        for _ in range(ADAPTIVE_WINDOW):
            drafts.record_verified(slots, np.array([1]), np.array([0]))
        assert sum(drafts.propose(slots)[0] == 0 for _ in range(pause + 1)) == pause
