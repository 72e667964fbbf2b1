"""DraftState: who drafts, drafts written after the history, draft lengths from each
request's acceptance and the measured cost of a row (StepCost), backoff and probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2.protocol import NEVER_DRAFTS
from mrv2.sampling_params import SamplingParams
from mrv2.spec_decode import step_cost
from mrv2.spec_decode.config import (ADAPTIVE_BACKOFF, LOOKUP_MISS_MAX_PAUSE,
                                     SpeculativeConfig)
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
    """A new request drafts as if 4 of 5 drafts were kept (3 at the default threshold of
    0.5: 0.8 ** 3 >= 0.5); kept drafts lengthen its runs, rejections shorten them."""
    requests, drafts = state(k=4)
    slots = np.array([add(requests, drafts, PERIODIC)])
    assert drafts.propose(slots).tolist() == [3]
    for _ in range(3):
        drafts.record_verified(slots, np.array([3]), np.array([3]))
    assert drafts.propose(slots).tolist() == [4]  # at most num_speculative_tokens
    lengths = []
    for _ in range(15):
        drafts.record_verified(slots, np.array([2]), np.array([0]))
        lengths.append(int(drafts.propose(slots)[0]))
    assert lengths == sorted(lengths, reverse=True) and lengths[0] >= 2 and lengths[-1] == 0


def test_threshold_is_a_rows_time_over_a_tokens():
    """Steps of 1 row take 10 ms and of 3 rows 20 ms: a row costs 5 ms, so at one request a
    draft needs a chance of 5 / 10, at four requests 4 * 5 / 25. Each count's first step
    (warm-up's) is left out; a multi-step run counts per step."""
    cost = step_cost.StepCost(8)
    assert cost.threshold(1) == step_cost.DEFAULT_THRESHOLD
    for rows, steps, seconds in ((1, 1, 5.0), (3, 1, 7.0), (1, 4, 0.040), (3, 1, 0.020)):
        cost.record(rows, steps, seconds)
    assert cost.threshold(1) == pytest.approx(0.5)
    assert cost.threshold(4) == pytest.approx(0.8)
    cost.record(99, 1, 1.0)  # past the rows it keeps: ignored
    assert cost.measured.tolist() == [False, True, False, True] + [False] * 5


def test_cheap_rows_lengthen_the_drafts():
    """Where a row costs little (matrix units) a request drafts more at the same chance."""
    requests, drafts = state(k=8, max_model_len=64)
    slots = np.array([add(requests, drafts, PERIODIC * 3)])
    assert drafts.propose(slots).tolist() == [3]
    drafts.threshold = 0.1  # the scheduler's, for a step (Speculator.begin_step)
    # 0.8 ** 8 = 0.17: all 8 pay (the n-gram match holds 4 of them)
    assert drafts._limits(slots, None, 1, 1)[1].tolist() == [8]
    assert drafts.propose(slots).tolist() == [4]


def test_max_rows_shares_a_steps_rows():
    requests, drafts = state(k=4)
    slots = np.array([add(requests, drafts, PERIODIC) for _ in range(3)])
    # 3 requests in 8 rows: 2 rows each, one for the sampled token and one draft
    assert drafts.propose(slots, max_rows=8).tolist() == [1, 1, 1]
    assert drafts.propose(slots, max_rows=3).tolist() == [0, 0, 0]


def stop_paying(drafts, slots):
    """Rejections until a draft no longer pays at the default threshold."""
    for _ in range(20):
        drafts.record_verified(slots, np.array([1]), np.array([0]))


def test_backoff_and_probes():
    """A request whose drafts do not pay stops drafting for ADAPTIVE_BACKOFF steps, then
    verifies one draft as a probe; a rejected probe doubles the pause, a kept draft brings it
    back to ADAPTIVE_BACKOFF."""
    requests, drafts = state()
    slots = np.array([add(requests, drafts, PERIODIC)])
    stop_paying(drafts, slots)
    for pause in (ADAPTIVE_BACKOFF, 2 * ADAPTIVE_BACKOFF, 4 * ADAPTIVE_BACKOFF):
        counts = [int(drafts.propose(slots)[0]) for _ in range(pause + 1)]
        assert counts == [0] * pause + [1]  # the probe
        drafts.record_verified(slots, np.array([1]), np.array([0]))
    drafts.record_verified(slots, np.array([1]), np.array([1]))  # a kept draft
    stop_paying(drafts, slots)
    counts = [int(drafts.propose(slots)[0]) for _ in range(ADAPTIVE_BACKOFF + 1)]
    assert counts == [0] * ADAPTIVE_BACKOFF + [1]


def test_a_lookup_that_finds_nothing_pauses_doubling_to_its_cap():
    """No match: the request looks again after 1 step, then 2, 4, ... up to
    LOOKUP_MISS_MAX_PAUSE (a run of decode steps each: `written`'s pauses); a run counts all
    its steps; a match brings the pause back to 1."""
    requests, drafts = state()
    slot = add(requests, drafts, [1, 2, 3, 4, 5, 6, 7, 8])  # no n-gram repeats
    slots = np.array([slot])
    pauses = []
    for _ in range(6):
        num = drafts.propose(slots, steps=pauses[-1] if pauses else 1)
        assert num.tolist() == [0]
        pauses.append(int(drafts.written(slots, num)[2][0]))
    assert pauses == [1, 2, 4, 8, 8, 8] and LOOKUP_MISS_MAX_PAUSE == 8
    assert drafts.propose(slots, steps=3).tolist() == [0]  # 5 steps of the pause left
    assert drafts.written(slots, np.zeros(1, np.int32))[2].tolist() == [5]
    history = PERIODIC + [5, 6, 7]  # now it repeats
    total = int(requests.total_len.numpy[slot])
    requests.token_ids.numpy[slot, total:total + len(history)] = history
    requests.total_len.numpy[slot] += len(history)
    assert drafts.propose(slots, steps=5).tolist() == [3]
    assert drafts.written(slots, np.array([3], np.int32))[2].tolist() == [0]
    assert drafts.miss_pause_host[slot] == 1


def test_a_request_that_never_drafts_has_no_pause():
    requests, drafts = state()
    slot = add(requests, drafts, PERIODIC, SamplingParams(prompt_logprobs=1))
    num = drafts.propose(np.array([slot]))
    assert drafts.written(np.array([slot]), num)[2].tolist() == [NEVER_DRAFTS]


def test_a_probe_is_kept_until_one_is_verified():
    """A probe whose lookup finds nothing is not spent: the request's next lookup probes."""
    requests, drafts = state()
    slot = add(requests, drafts, PERIODIC)
    slots = np.array([slot])
    stop_paying(drafts, slots)
    assert [int(drafts.propose(slots)[0]) for _ in range(ADAPTIVE_BACKOFF)] == (
        [0] * ADAPTIVE_BACKOFF)
    total = int(requests.total_len.numpy[slot])
    requests.token_ids.numpy[slot, total] = 99  # a token never seen: no match
    requests.total_len.numpy[slot] += 1
    assert drafts.propose(slots).tolist() == [0]  # the probe's lookup missed
    requests.token_ids.numpy[slot, total + 1:total + 3] = [5, 6]  # "5 6" repeats
    requests.total_len.numpy[slot] += 2
    assert drafts.propose(slots).tolist() == [1]  # still the probe: one draft
    drafts.record_verified(slots, np.array([1]), np.array([0]))
    assert not drafts.probe_host[slot]
