"""Protocol structs: msgpack round trips of everything that crosses a process boundary."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mrv2.protocol import (
    SampledTokenLogprobs,
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobsChunk,
    SchedulerOutput,
)
from mrv2.sampling_params import SamplingParams


def round_trip(obj):
    data = msgspec.msgpack.encode(obj)
    back = msgspec.msgpack.decode(data, type=type(obj))
    assert back == obj
    assert type(back) is type(obj)
    return back


def new_request(req_id: str = "r0", **params) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        prefill_token_ids=[1, 2, 3, 9, 8],
        sampling_params=SamplingParams(temperature=0.5, top_k=4, stop="x", seed=7,
                                       logit_bias={5: -2.0}, **params),
        block_ids=[[4, 7]],  # one KV cache group
        num_computed_tokens=2,
    )


def test_new_request_data_with_nested_sampling_params() -> None:
    back = round_trip(new_request())
    assert isinstance(back.sampling_params, SamplingParams)
    assert back.sampling_params.stop == ["x"]
    assert back.sampling_params.seed == 7
    assert back.sampling_params.logit_bias == {5: -2.0}
    assert back.prefill_token_ids == [1, 2, 3, 9, 8]
    assert back.eos_token_id is None
    assert back.block_ids == [[4, 7]]
    assert round_trip(msgspec.structs.replace(new_request(), eos_token_id=4)).eos_token_id == 4


def test_structs_are_array_like() -> None:
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(new_request()))
    assert isinstance(raw, list) and raw[0] == "r0" and raw[5:] == [2, None, []]


def test_cached_request_data() -> None:
    cached = CachedRequestData.build(req_ids=["a", "b"], new_block_ids=[[[3]], [[]]],
                                     num_computed_tokens=[10, 4])
    back = round_trip(cached)
    assert back.num_reqs == 2 and back.req_ids == ["a", "b"] and back.num_kv_groups == 1
    assert back.new_block_ids == [[[3]], [[]]] and back.num_computed_tokens.tolist() == [10, 4]
    assert back.new_block_ids_flat.tolist() == [3] and back.num_new_blocks.tolist() == [[1, 0]]
    # Two KV cache groups: the ids and counts are flat group after group.
    two = round_trip(CachedRequestData.build(["a", "b"], [[[3], [8, 9]], [[], [5]]], [10, 4]))
    assert two.num_kv_groups == 2 and two.new_block_ids == [[[3], [8, 9]], [[], [5]]]
    assert two.new_block_ids_flat.tolist() == [3, 8, 9, 5]
    assert two.num_new_blocks.tolist() == [[1, 0], [2, 1]]
    with pytest.raises(ValueError, match="every request needs 2 block-id lists"):
        CachedRequestData.build(["a", "b"], [[[3], []], [[]]], [1, 2])
    empty = round_trip(CachedRequestData())
    assert empty.num_reqs == 0 and empty.new_block_ids == [] and empty.req_ids == []
    # The list views are fresh objects: mutating one never touches the message.
    assert CachedRequestData().req_ids is not CachedRequestData().req_ids
    with pytest.raises(ValueError, match="2 ids, 1 block-id lists"):
        CachedRequestData.build(["a", "b"], [[[]]], [1, 2])
    with pytest.raises(ValueError, match="NUL"):
        CachedRequestData.build(["a\0b"], [[[]]], [1])


def test_step_structs_are_compact_on_the_wire() -> None:
    """256 decodes cost a handful of msgpack objects, not hundreds: ids travel as one UTF-8
    blob, per-request numbers as int32 bytes (the step's serialisation cost)."""
    ids = [f"cmpl-{i:08x}-0" for i in range(256)]
    out = SchedulerOutput.build([], CachedRequestData.build(ids, [[[]]] * 256, [100] * 256),
                                dict.fromkeys(ids, 1), 256)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(out))
    assert raw[1][0] == raw[2] == "\0".join(ids).encode()
    assert isinstance(raw[4], bytes) and len(raw[4]) == 4 * 256
    assert not out.num_scheduled.flags.writeable  # a read-only view of the frozen message


def test_scheduler_output_keeps_batch_order() -> None:
    out = SchedulerOutput.build(
        scheduled_new_reqs=[new_request("n1"), new_request("n2", max_tokens=4)],
        scheduled_cached_reqs=CachedRequestData.build(req_ids=["z", "a"],
                                                      new_block_ids=[[[]], [[5]]],
                                                      num_computed_tokens=[7, 12]),
        num_scheduled_tokens={"z": 1, "a": 1, "n2": 3, "n1": 2},
        total_num_scheduled_tokens=7,
        finished_req_ids=["f"],
        preempted_req_ids=["p1", "p2"],
    )
    back = round_trip(out)
    # Insertion order of num_scheduled_tokens is the batch order.
    assert list(back.num_scheduled_tokens) == ["z", "a", "n2", "n1"]
    assert back.req_ids == ["z", "a", "n2", "n1"] and back.num_scheduled.tolist() == [1, 1, 3, 2]
    assert back.cached_rows_first  # running requests are the first rows
    reordered = SchedulerOutput.build([], out.scheduled_cached_reqs, {"a": 1, "z": 1}, 2)
    assert not reordered.cached_rows_first
    assert back.scheduled_new_reqs[1].sampling_params.max_tokens == 4
    assert not back.is_empty


def test_empty_scheduler_output() -> None:
    out = SchedulerOutput.build(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    back = round_trip(out)
    assert back.is_empty
    assert back.finished_req_ids == [] and back.preempted_req_ids == []


def test_grammar_output() -> None:
    bitmask = np.array([[-1, 0, 5], [7, -2, 1 << 30]], dtype=np.int32)
    back = round_trip(GrammarOutput.build([3, 0], bitmask))
    assert back.num_rows == 2 and back.rows.tolist() == [3, 0]
    np.testing.assert_array_equal(back.bitmask, bitmask)
    empty = round_trip(GrammarOutput())
    assert empty.num_rows == 0 and empty.bitmask.shape == (0, 0)
    with pytest.raises(ValueError, match="int32"):
        GrammarOutput.build([1], bitmask.astype(np.int64)[:1])
    with pytest.raises(ValueError):
        GrammarOutput.build([1, 2, 3], bitmask)


def test_model_runner_output() -> None:
    lp = SampledTokenLogprobs(token_ids=[5, 5, 9], logprobs=[-0.25, -0.25, -1.5], rank=1)
    out = ModelRunnerOutput.build(req_ids=["a", "b"], sampled_token_ids=[[5], []],
                            logprobs=[[lp], None], nan_req_ids=["b"])
    back = round_trip(out)
    assert back.sampled_token_ids == [[5], []] and back.req_ids == ["a", "b"]
    assert back.sampled.tolist() == [5] and back.num_sampled.tolist() == [1, 0]
    assert back.logprobs == [[lp], None]
    assert back.nan_req_ids == ["b"]
    minimal = round_trip(ModelRunnerOutput.build(req_ids=[], sampled_token_ids=[]))
    assert minimal.logprobs is None and minimal.nan_req_ids == []
    assert minimal.pooled is None


def test_pooled_vectors_round_trip() -> None:
    """A pooling runner's vectors (float32 bytes) cross both boundaries unchanged."""
    vector = np.array([0.5, -1.25, 3.0], dtype=np.float32).tobytes()
    back = round_trip(ModelRunnerOutput.build(req_ids=["a", "b"], sampled_token_ids=[[1], []],
                                              pooled={"a": vector}))
    assert back.pooled == {"a": vector}
    out = round_trip(EngineCoreOutputs(outputs=[EngineCoreOutput("a", [1], pooled=vector),
                                                EngineCoreOutput("b", [])]))
    assert np.frombuffer(out.outputs[0].pooled, np.float32).tolist() == [0.5, -1.25, 3.0]
    assert out.outputs[1].pooled is None


def test_engine_core_request() -> None:
    req = EngineCoreRequest(request_id="abc", prompt_token_ids=[1, 2],
                            sampling_params=SamplingParams(max_tokens=3, stop=["\n"]),
                            eos_token_id=None, arrival_time=1234.5)
    back = round_trip(req)
    assert back.sampling_params.stop == ["\n"]
    assert back.eos_stop_token_ids == ()
    back = round_trip(EngineCoreRequest(request_id="x", prompt_token_ids=[0],
                                        sampling_params=SamplingParams(), eos_token_id=2,
                                        arrival_time=0.0, eos_stop_token_ids=(5, 9)))
    assert back.eos_stop_token_ids == (5, 9)  # a tuple again: the stop check's membership test


@pytest.mark.parametrize("reason, stop_reason", [
    (None, None), (FinishReason.STOP, 7), (FinishReason.STOP, "</s>"),
    (FinishReason.LENGTH, None), (FinishReason.ABORT, None),
])
def test_engine_core_output(reason: FinishReason | None, stop_reason: int | str | None) -> None:
    out = EngineCoreOutput(request_id="r", new_token_ids=[4, 5], finish_reason=reason,
                           stop_reason=stop_reason)
    back = round_trip(out)
    assert back.finished == (reason is not None)
    assert back.finish_reason is reason
    assert back.stop_reason == stop_reason
    assert type(back.stop_reason) is type(stop_reason)


def test_logprobs_fields_round_trip() -> None:
    """Sample and prompt logprobs cross both boundaries (worker -> core, core -> front end),
    -inf (a filtered token) included."""
    lp = SampledTokenLogprobs(token_ids=[5, 2], logprobs=[-0.5, float("-inf")], rank=3)
    prompt = PromptLogprobsChunk(start=4, token_ids=[[7, 1], [8, 8]],
                                 logprobs=[[-2.0, -0.1], [-0.3, -0.3]], ranks=[9, 1])
    assert prompt.num_rows == 2
    back = round_trip(ModelRunnerOutput.build(req_ids=["a"], sampled_token_ids=[[5]],
                                              logprobs=[[lp]], prompt_logprobs={"a": prompt}))
    assert back.prompt_logprobs == {"a": prompt}
    out = round_trip(EngineCoreOutputs(outputs=[
        EngineCoreOutput("a", [5], new_logprobs=[lp], new_prompt_logprobs=prompt),
        EngineCoreOutput("b", [], new_prompt_logprobs=prompt)]))
    assert out.outputs[0].new_logprobs[0].logprobs[1] == float("-inf")
    assert out.outputs[1].new_logprobs is None and out.outputs[1].new_token_ids == []


def test_engine_core_outputs() -> None:
    outs = EngineCoreOutputs(outputs=[
        EngineCoreOutput("a", [1]),
        EngineCoreOutput("b", [], finish_reason=FinishReason.ABORT),
    ], timestamp=3.25)
    back = round_trip(outs)
    assert back.outputs[1].finish_reason is FinishReason.ABORT
    assert round_trip(EngineCoreOutputs()).outputs == []


def test_finish_reason() -> None:
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert [int(r) for r in FinishReason] == [0, 1, 2, 3]
    # Encoded as its integer value, decoded back into the enum.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(FinishReason.LENGTH)) == 1
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(FinishReason.ABORT),
                                  type=FinishReason) is FinishReason.ABORT
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(4), type=FinishReason)


def test_structs_are_frozen() -> None:
    req = new_request()
    with pytest.raises(AttributeError):
        req.req_id = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        EngineCoreOutput("a", [1]).finish_reason = FinishReason.STOP  # type: ignore[misc]


def test_decoding_rejects_wrong_types() -> None:
    bad = msgspec.msgpack.encode(["r", [1], [1], {}, [1], "not-an-int"])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(bad, type=NewRequestData)
