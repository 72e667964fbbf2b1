import pytest

from mrv2.core.request import Request, RequestStatus
from mrv2.protocol import EngineCoreRequest, FinishReason
from mrv2.sampling_params import SamplingParams


def test_status_is_finished_and_reason() -> None:
    alive = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(s.is_finished for s in alive)
    assert all(s.finish_reason is None for s in alive)
    assert RequestStatus.FINISHED_STOPPED.finish_reason is FinishReason.STOP
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.FINISHED_ABORTED.finish_reason is FinishReason.ABORT
    assert all(s.is_finished for s in RequestStatus if s not in alive)


def test_token_bookkeeping() -> None:
    prompt = [5, 6, 7]
    req = Request("r", prompt, SamplingParams(max_tokens=4), eos_token_id=2, arrival_time=1.5)
    prompt.append(99)  # the request keeps its own copy
    assert req.prompt_token_ids == [5, 6, 7]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (3, 3, 0)
    assert req.status is RequestStatus.WAITING and not req.is_finished
    assert req.num_computed_tokens == 0 and req.num_preemptions == 0 and req.stop_reason is None
    req.append_output_token_ids(8)
    req.append_output_token_ids([9, 10])
    assert req.output_token_ids == [8, 9, 10]
    assert req.all_token_ids == [5, 6, 7, 8, 9, 10]
    assert (req.num_tokens, req.num_output_tokens) == (6, 3)
    assert "Request('r'" in repr(req)


def test_max_tokens_resolution() -> None:
    given = Request("a", [1, 2], SamplingParams(max_tokens=7), max_model_len=100)
    assert given.max_tokens == 7
    unset = Request("b", [1, 2, 3], SamplingParams(max_tokens=None), max_model_len=10)
    assert unset.max_tokens == 7
    with pytest.raises(ValueError, match="max_model_len"):
        Request("c", [1], SamplingParams(max_tokens=None))


def test_from_engine_core_request() -> None:
    params = SamplingParams(max_tokens=None, temperature=0.0)
    core_req = EngineCoreRequest(request_id="x", prompt_token_ids=[4, 5, 6, 7],
                                 sampling_params=params, eos_token_id=3, arrival_time=12.0,
                                 eos_stop_token_ids=(8, 9))
    req = Request.from_engine_core_request(core_req, max_model_len=32)
    assert req.eos_stop_token_ids == (8, 9)
    assert req.request_id == "x"
    assert req.prompt_token_ids == [4, 5, 6, 7]
    assert req.prompt_token_ids is not core_req.prompt_token_ids
    assert req.sampling_params is params
    assert req.eos_token_id == 3 and req.arrival_time == 12.0
    assert req.max_tokens == 28
