"""executor/serial.py: protocol structs, numpy arrays and torch tensors through msgpack frames;
zero-copy decoding; RPC envelopes decoded against the target method's type hints."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.serial import (ALL_RANKS, MethodTypes, MsgpackDecoder, MsgpackEncoder, Ready,
                             RemoteError, RPCCall, RPCReply)
from executor.shm_queue import ShmQueueHandle
from mrv2 import protocol
from mrv2.errors import WorkerError
from mrv2.protocol import (CachedRequestData, CoreDead, CoreReady, CoreStats, EngineCoreOutput,
                           EngineCoreOutputs, EngineCoreRequest, FinishReason, GrammarOutput,
                           ModelRunnerOutput, NewRequestData, PromptLogprobsChunk,
                           RequestRejected, SampledTokenLogprobs, SchedulerOutput, UtilityCall,
                           UtilityResult)
from mrv2.sampling_params import SamplingParams


def round_trip(obj: Any, type: Any = Any, **encoder_kwargs) -> Any:
    frames = MsgpackEncoder(**encoder_kwargs).encode(obj)
    # What a transport hands over: private, writable copies.
    return MsgpackDecoder(type).decode([bytearray(f) for f in frames])


# -- protocol structs (property-based) ---------------------------------------------------------

# Request ids hold no NUL and no lone surrogate (the scheduler refuses them: executor/packed.py).
PACKABLE = st.characters(blacklist_characters="\0", blacklist_categories=("Cs",))
ids = st.text(PACKABLE, min_size=1, max_size=12)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=20)
floats = st.floats(allow_nan=False)  # +-inf included (a filtered token's logprob); NaN != NaN
# Every field away from its default some of the time: SamplingParams omits defaults on the wire.
# min_tokens <= 1 <= max_tokens keeps the pair valid.
sampling = st.builds(
    SamplingParams, n=st.integers(1, 4), presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2), repetition_penalty=st.floats(0.01, 10),
    temperature=st.floats(0, 2), top_p=st.floats(0.01, 1.0),
    top_k=st.integers(-1, 100), min_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.none() | st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=st.none() | tokens, max_tokens=st.none() | st.integers(1, 4096),
    min_tokens=st.integers(0, 1), logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20), ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(), spaces_between_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans(),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 50000), st.floats(-100, 100),
                                           max_size=3),
    allowed_token_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5))
new_reqs = st.builds(NewRequestData, req_id=ids, prompt_token_ids=tokens,
                     prefill_token_ids=tokens, sampling_params=sampling,
                     block_ids=st.lists(tokens, min_size=1, max_size=3),  # per KV cache group
                     num_computed_tokens=st.integers(0, 10**6))
# n requests, each with g KV cache groups' new block ids.
cached = st.tuples(st.integers(0, 6), st.integers(1, 3)).flatmap(lambda ng: st.builds(
    CachedRequestData.build, req_ids=st.lists(ids, min_size=ng[0], max_size=ng[0]),
    new_block_ids=st.lists(st.lists(tokens, min_size=ng[1], max_size=ng[1]),
                           min_size=ng[0], max_size=ng[0]),
    num_computed_tokens=st.lists(st.integers(0, 10**6), min_size=ng[0], max_size=ng[0])))
scheduler_outputs = st.builds(
    SchedulerOutput.build, scheduled_new_reqs=st.lists(new_reqs, max_size=4),
    scheduled_cached_reqs=cached,
    num_scheduled_tokens=st.dictionaries(ids, st.integers(1, 2048), max_size=8),
    total_num_scheduled_tokens=st.integers(0, 10**5), finished_req_ids=st.lists(ids, max_size=4),
    preempted_req_ids=st.lists(ids, max_size=4))
grammar_outputs = st.integers(0, 4).flatmap(lambda n: st.builds(
    GrammarOutput.build, rows=st.lists(st.integers(0, 255), min_size=n, max_size=n),
    bitmask=st.integers(0, 3).map(lambda words: np.random.default_rng(n + words).integers(
        -2**31, 2**31, (n, words), dtype=np.int32))))
sample_logprobs = st.builds(SampledTokenLogprobs, token_ids=tokens,
                            logprobs=st.lists(floats, max_size=4), rank=st.integers(1, 10**6))
prompt_chunks = st.integers(0, 4).flatmap(lambda n: st.builds(
    PromptLogprobsChunk, start=st.integers(0, 10**6),
    token_ids=st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4), min_size=n,
                       max_size=n),
    logprobs=st.lists(st.lists(floats, min_size=1, max_size=4), min_size=n, max_size=n),
    ranks=st.lists(st.integers(1, 10**6), min_size=n, max_size=n)))
runner_outputs = st.integers(0, 6).flatmap(lambda n: st.builds(
    ModelRunnerOutput.build, req_ids=st.lists(ids, min_size=n, max_size=n),
    sampled_token_ids=st.lists(tokens, min_size=n, max_size=n),
    logprobs=st.none() | st.lists(st.none() | st.lists(sample_logprobs, min_size=1,
                                                        max_size=2), max_size=4),
    nan_req_ids=st.lists(ids, max_size=3),
    prompt_logprobs=st.none() | st.dictionaries(ids, prompt_chunks, max_size=3)))
core_requests = st.builds(EngineCoreRequest, request_id=ids, prompt_token_ids=tokens,
                          sampling_params=sampling, eos_token_id=st.none() | st.integers(0, 10**5),
                          arrival_time=st.floats(0, 1e10))
core_output = st.builds(
    EngineCoreOutput, request_id=ids, new_token_ids=tokens,
    finish_reason=st.none() | st.sampled_from(FinishReason),
    stop_reason=st.none() | st.integers(0, 10**5) | st.text(max_size=5),
    new_logprobs=st.none() | st.lists(sample_logprobs, max_size=3),
    new_prompt_logprobs=st.none() | prompt_chunks)
core_outputs = st.builds(EngineCoreOutputs, outputs=st.lists(core_output, max_size=4),
                         timestamp=st.floats(0, 1e10))
queue_handles = st.builds(ShmQueueHandle, name=ids, num_readers=st.integers(1, 8),
                          num_chunks=st.integers(1, 64), chunk_bytes=st.integers(64, 2**31),
                          zmq_address=ids, wake_address=ids)
counts = st.integers(0, 2**20)
# One strategy per struct that crosses a process boundary: every struct of mrv2/protocol.py
# (test_every_protocol_struct_has_a_strategy keeps this complete), the structs nested in them,
# and the executor's own (start-up handshake, queue handles, remote errors).
STRATEGIES: dict[type, st.SearchStrategy] = {
    NewRequestData: new_reqs, CachedRequestData: cached, SchedulerOutput: scheduler_outputs,
    GrammarOutput: grammar_outputs, SampledTokenLogprobs: sample_logprobs,
    PromptLogprobsChunk: prompt_chunks, ModelRunnerOutput: runner_outputs,
    EngineCoreRequest: core_requests, EngineCoreOutput: core_output,
    EngineCoreOutputs: core_outputs, SamplingParams: sampling, ShmQueueHandle: queue_handles,
    RemoteError: st.builds(RemoteError, ids, ids, st.text(max_size=20), st.text(max_size=40)),
    Ready: st.builds(Ready, rank=st.integers(0, 7), pid=st.integers(1, 2**22),
                     response=st.none() | queue_handles, error=st.none() | st.text(max_size=40)),
    # Front end <-> engine-core process (the core process side: mrv2/core/core_proc.py).
    UtilityCall: st.builds(UtilityCall, st.integers(0, 2**31), ids,
                           st.lists(st.integers(0, 2**31) | st.text(max_size=8), max_size=3)),
    UtilityResult: st.builds(UtilityResult, st.integers(0, 2**31),
                             st.none() | st.integers(0, 2**31) | st.text(max_size=8),
                             st.none() | st.text(max_size=20), st.text(max_size=12),
                             st.text(max_size=40)),
    RequestRejected: st.builds(RequestRejected, ids, ids, st.text(max_size=20)),
    CoreDead: st.builds(CoreDead, st.text(max_size=40)),
    CoreReady: st.builds(CoreReady, st.integers(1, 2**22), st.none() | st.text(max_size=40),
                         st.text(max_size=12), st.integers(0, 2**20)),
    CoreStats: st.builds(CoreStats, num_running=counts, num_waiting=counts,
                         num_unfinished=counts, has_unfinished=st.booleans(),
                         kv_cache_usage=st.floats(0.0, 1.0), num_free_blocks=counts,
                         num_kv_blocks=counts, num_preemptions=counts,
                         prefix_cache_queries=counts, prefix_cache_hits=counts),
}


def test_every_protocol_struct_has_a_strategy():
    defined = {obj for obj in vars(protocol).values() if isinstance(obj, type)
               and issubclass(obj, msgspec.Struct) and obj.__module__ == protocol.__name__}
    assert len(defined) >= 10
    assert not defined - set(STRATEGIES), "add a strategy for each new protocol struct"


@pytest.mark.parametrize("cls", list(STRATEGIES), ids=lambda cls: cls.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_protocol_struct_round_trips(cls, data):
    obj = data.draw(STRATEGIES[cls])
    assert type(obj) is cls
    back = round_trip(obj, cls)
    assert back == obj and type(back) is cls
    if isinstance(obj, SchedulerOutput):  # dict order is the batch order
        assert list(back.num_scheduled_tokens) == list(obj.num_scheduled_tokens)
    # The single-buffer form decodes the same.
    assert MsgpackDecoder(cls).decode(MsgpackEncoder(oob_threshold=None).encode(obj)[0]) == obj


@settings(max_examples=50, deadline=None)
@given(scheduler_outputs)
def test_scheduler_output_through_rpc_envelope_arrives_typed(obj):
    class Target:
        def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    types = MethodTypes(Target)
    frames = [bytearray(f) for f in MsgpackEncoder().encode(
        RPCCall(7, "execute_model", (obj,), reply_rank=0))]
    call = types.decode_call(frames)
    assert (call.call_id, call.method, call.reply_rank, call.function) == (7, "execute_model", 0,
                                                                           None)
    (arg,) = types.decode_args(call, frames)
    assert isinstance(arg, SchedulerOutput) and arg == obj


# -- arrays and tensors ------------------------------------------------------------------------

NP_DTYPES = [np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_,
             np.complex64]
TORCH_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                torch.int8, torch.uint8, torch.bool, torch.float64]
SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 64)]


def _address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("dtype", NP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_arrays_round_trip(dtype, shape):
    rng = np.random.default_rng(0)
    arr = np.asarray(rng.standard_normal(shape) * 50).astype(dtype)
    back = round_trip({"x": arr, "n": 3})
    assert back["n"] == 3
    assert back["x"].dtype == arr.dtype and back["x"].shape == arr.shape
    np.testing.assert_array_equal(back["x"], arr)
    assert back["x"].flags.writeable


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_tensors_round_trip(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    back = round_trip([t, "tail"])
    assert back[1] == "tail"
    assert isinstance(back[0], torch.Tensor)
    assert back[0].dtype == dtype and back[0].shape == t.shape
    assert torch.equal(back[0], t)


def test_large_arrays_are_out_of_band_and_decoded_without_copy():
    arr = np.arange(1000, dtype=np.float32)
    ten = torch.arange(2048, dtype=torch.bfloat16).reshape(32, 64)
    frames = MsgpackEncoder().encode({"a": arr, "t": ten, "small": np.arange(4)})
    assert len(frames) == 3  # the body + two raw buffers; the small one stays inline
    assert len(frames[0]) < 200  # no array bytes in the body
    received = [bytearray(f) for f in frames]
    back = MsgpackDecoder().decode(received)
    assert np.shares_memory(back["a"], np.frombuffer(received[1], dtype=np.uint8))
    assert back["t"].data_ptr() == _address(received[2])
    np.testing.assert_array_equal(back["a"], arr)
    assert torch.equal(back["t"], ten)
    back["t"][0, 0] = 5.0  # writable, and the write lands in the received buffer
    assert back["t"].data_ptr() == _address(received[2])


def test_encoding_does_not_copy_out_of_band_arrays():
    arr = np.arange(1000, dtype=np.int64)
    frames = MsgpackEncoder().encode(arr)
    assert _address(frames[1]) == arr.ctypes.data


def test_read_only_or_misaligned_frames_are_copied():
    t = torch.arange(100, dtype=torch.int64)
    frames = MsgpackEncoder().encode(t)
    back = MsgpackDecoder().decode([bytes(f) for f in frames])  # read-only buffers
    assert torch.equal(back, t)
    back.add_(1)  # a private copy: writable without warnings
    shifted = bytearray(1) + bytearray(frames[1])
    back = MsgpackDecoder().decode([frames[0], memoryview(shifted)[1:]])
    assert torch.equal(back, t) and back.data_ptr() % 8 == 0


def test_non_contiguous_and_grad_tensors():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[:, ::2].t()
    param = torch.ones(3, requires_grad=True)
    back = round_trip((view, param, np.arange(24).reshape(4, 6)[:, 1::3]))
    assert torch.equal(back[0], view) and torch.equal(back[1], param.detach())
    np.testing.assert_array_equal(back[2], np.arange(24).reshape(4, 6)[:, 1::3])


def test_all_inline_encoder_gives_one_frame():
    frames = MsgpackEncoder(oob_threshold=None).encode(np.arange(10000))
    assert len(frames) == 1
    np.testing.assert_array_equal(MsgpackDecoder().decode(frames), np.arange(10000))


def test_typed_array_fields_decode():
    class Holder(msgspec.Struct, array_like=True):
        a: np.ndarray
        t: torch.Tensor
        rest: list[int]

    back = round_trip(Holder(np.ones(300), torch.zeros(300, dtype=torch.int32), [1]), Holder)
    assert isinstance(back.a, np.ndarray) and isinstance(back.t, torch.Tensor)
    assert back.a.sum() == 300 and back.t.dtype == torch.int32 and back.rest == [1]


def test_unsupported_objects_are_refused_not_pickled():
    with pytest.raises(TypeError, match="cannot encode an object of type object"):
        MsgpackEncoder().encode(object())
    with pytest.raises(TypeError, match="dtype object"):
        MsgpackEncoder().encode(np.array([object()]))
    if torch.cuda.is_available():
        with pytest.raises(TypeError, match="CPU"):
            MsgpackEncoder().encode(torch.zeros(2, device="cuda"))


def test_numpy_scalars_encode_as_python_scalars():
    assert round_trip({"x": np.float32(1.5), "i": np.int64(3)}) == {"x": 1.5, "i": 3}


# -- RPC envelopes -----------------------------------------------------------------------------

class Target:
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def untyped(self, a, b): ...


def test_method_types_decode_args_and_results():
    types, enc = MethodTypes(Target), MsgpackEncoder()
    grammar = GrammarOutput.build([3], np.array([[-1, 5]], dtype=np.int32))
    for args in [(grammar,), (GrammarOutput(),), (None,)]:
        frames = enc.encode(RPCCall(1, "sample_tokens", args))
        assert types.decode_args(types.decode_call(frames), frames) == args
    frames = enc.encode(RPCCall(2, "untyped", ({"k": [1, 2]}, np.arange(300))))
    a, b = types.decode_args(types.decode_call(frames), frames)
    assert a == {"k": [1, 2]} and np.array_equal(b, np.arange(300))
    frames = enc.encode(RPCCall(3, "initialize_kv_cache", ("not an int",)))
    with pytest.raises(msgspec.ValidationError):
        types.decode_args(types.decode_call(frames), frames)

    out = ModelRunnerOutput.build(["a", "b"], [[1], [2, 3]])
    reply, value = types.decode_reply(enc.encode(RPCReply(2, 0, out)), "sample_tokens")
    assert (reply.call_id, reply.rank) == (2, 0) and value == out
    assert isinstance(value, ModelRunnerOutput)
    reply, value = types.decode_reply(enc.encode(RPCReply(3, 0, [1, 2])), None)
    assert value == [1, 2]
    assert ALL_RANKS == RPCCall(0, "m").reply_rank


def test_remote_errors_rebuild_their_type_with_the_remote_traceback():
    try:
        raise RuntimeError("phase 2 without a pending execute_model")
    except RuntimeError as e:
        remote = RemoteError.from_exception(e, "Traceback (most recent call last): ...")
    frames = MsgpackEncoder().encode(RPCReply(1, 0, None, remote))
    reply, _ = MethodTypes(Target).decode_reply(frames, "sample_tokens")
    error = reply.error.to_exception(rank=0)
    assert type(error) is RuntimeError and "without a pending" in str(error)
    assert error.remote_traceback.startswith("Traceback")
    unknown = RemoteError("no_such_module", "Boom", "it broke", "tb").to_exception(rank=1)
    assert isinstance(unknown, WorkerError) and unknown.rank == 1
    assert "no_such_module.Boom: it broke" in str(unknown) and unknown.remote_traceback == "tb"


@pytest.mark.parametrize("num_args", [0, 1, 2, 15, 16, 17])
def test_decode_args_picks_the_decoder_by_argument_count(num_args):
    """The decoder cache is keyed by the arguments' first byte (a fixarray's length): each
    count gets its own decoder, typed where the method has hints, also past 15 arguments."""
    types, enc = MethodTypes(Target), MsgpackEncoder()
    for _ in range(2):  # a miss, then the cached decoder
        args = (7, *range(num_args - 1)) if num_args else ()
        frames = enc.encode(RPCCall(1, "initialize_kv_cache", args))
        assert types.decode_args(types.decode_call(frames), frames) == args
    frames = enc.encode(RPCCall(2, "initialize_kv_cache", ("seven",)))
    with pytest.raises(msgspec.ValidationError):  # still typed after other counts were cached
        types.decode_args(types.decode_call(frames), frames)
