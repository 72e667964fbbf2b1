"""RunStops (mrv2/sampler/run_stops.py): a slot's ids are exactly the scheduler's stop check's
for an argmax row, and a slot whose ids do not fit holds none."""

from __future__ import annotations

import numpy as np

from mrv2.core.request import Request
from mrv2.sampler.run_stops import NO_STOP, RUN_STOP_WIDTH, RunStops
from mrv2.sampling_params import SamplingParams


def _ids(stops: RunStops, slot: int) -> set[int]:
    return {int(t) for t in stops.rows(np.array([slot]))[0] if t != NO_STOP}


def _scheduler_stops_on(params: SamplingParams, eos: int, others: tuple[int, ...],
                        token: int) -> bool:
    request = Request("r", [3, 4], params, eos_token_id=eos, max_model_len=64,
                      eos_stop_token_ids=others)
    request.append_output_token_ids(token)
    return request.check_stop(64)


def test_a_slot_holds_the_ids_the_scheduler_stops_on():
    stops = RunStops(4)
    cases = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, ignore_eos=True),
             SamplingParams(max_tokens=10, stop_token_ids=[7, 9]),
             SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[9])]
    for slot, params in enumerate(cases):
        stops.add(slot, params, eos_token_id=2, eos_stop_token_ids=(5, 6))
        ids = _ids(stops, slot)
        for token in range(12):
            assert (token in ids) == _scheduler_stops_on(params, 2, (5, 6), token), (slot, token)
    assert _ids(stops, 0) == {2, 5, 6} and _ids(stops, 1) == set()
    assert _ids(stops, 2) == {2, 5, 6, 7, 9} and _ids(stops, 3) == {9}


def test_a_new_request_replaces_the_slot_s_ids_and_too_many_give_none():
    stops = RunStops(2)
    stops.add(1, SamplingParams(max_tokens=10, stop_token_ids=[7]), 2, ())
    stops.add(1, SamplingParams(max_tokens=10), None, ())  # no EOS at all
    assert _ids(stops, 1) == set()
    many = list(range(100, 100 + RUN_STOP_WIDTH))  # with the EOS one more than fits
    stops.add(0, SamplingParams(max_tokens=10, stop_token_ids=many), 2, ())
    assert _ids(stops, 0) == set()  # never ends a run early: the run goes to its end
    stops.add(0, SamplingParams(max_tokens=10, stop_token_ids=many[1:]), 2, ())
    assert _ids(stops, 0) == {2, *many[1:]}
    rows = stops.rows(np.array([1, 0]))
    assert rows.shape == (2, RUN_STOP_WIDTH) and rows.dtype == np.int64
    rows[:] = 0  # a copy: the table is unchanged
    assert _ids(stops, 0) == {2, *many[1:]}
