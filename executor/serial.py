"""msgspec msgpack serialisation for everything that crosses a process boundary.

Protocol structs encode natively. numpy arrays and CPU torch tensors travel as raw bytes in a
msgpack extension: a one-byte header length, a small msgpack header `(dtype, shape, frame)`, and
then either the bytes themselves (`frame == -1`, small arrays) or nothing, the bytes being
out-of-band frame number `frame` of the message (arrays of `oob_threshold` bytes or more).
A message is therefore a list of buffers: `frames[0]` is the msgpack body, `frames[1:]` are raw
array bytes that a transport can write without copying them into the body. Decoding wraps
out-of-band frames with `np.frombuffer` / `torch.frombuffer`: no copy, as long as the frame is
writable and (for torch) aligned; otherwise the bytes are copied once. Nothing is pickled.

RPC envelopes (`RPCCall`, `RPCReply`, `RemoteError`; and `Ready`, a worker's start-up message)
are every executor message type that crosses a process boundary; the engine's own messages are
in mrv2/protocol.py. `RPCCall` and `RPCReply` carry a method name and its arguments. Arguments and
results are decoded against the target method's type hints (`MethodTypes`), so a
`SchedulerOutput` argument arrives as a `SchedulerOutput`, not as a list.
"""

from __future__ import annotations

import inspect
import math
import sys
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from executor.deferred import resolved_type
from executor.errors import WorkerError
from executor.shm_ring import ShmQueueHandle

EXT_NDARRAY = 1
EXT_TENSOR = 2
ALL_RANKS = -1
NO_REPLY = -2  # reply_rank of calls nobody answers
SHUTDOWN_METHOD = "__shutdown__"  # the method name of the call that ends the worker loop

Buffer = bytes | bytearray | memoryview

_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int])
_TORCH_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, *(getattr(torch, n) for n in ("uint16", "uint32", "uint64",
                                                "float8_e4m3fn", "float8_e5m2")
                  if hasattr(torch, n)))}


def _raw_bytes_numpy(arr: np.ndarray) -> tuple[str, tuple[int, ...], np.ndarray]:
    if arr.dtype.hasobject or arr.dtype.fields is not None:
        raise TypeError(f"cannot encode a numpy array of dtype {arr.dtype}: only plain numeric "
                        f"dtypes travel as raw bytes")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return arr.dtype.str, arr.shape, flat


def _raw_bytes_tensor(t: torch.Tensor) -> tuple[str, tuple[int, ...], np.ndarray]:
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise TypeError(f"cannot encode a {t.device.type} {t.layout} tensor: move it to a dense "
                        f"CPU tensor first (an implicit device copy would stall the step)")
    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TypeError(f"cannot encode a tensor of dtype {t.dtype}")
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return name, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


class MsgpackEncoder:
    """Encodes one object into frames. Not thread-safe: one encoder per sending thread."""

    def __init__(self, oob_threshold: int | None = 256) -> None:
        # None: every array inline (one frame), for transports that want a single buffer.
        self.oob_threshold = oob_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        frames: list[Buffer] = [b""]
        self._frames = frames if self.oob_threshold is not None else None
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = None
        return frames

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        if isinstance(obj, np.ndarray):
            code, (dtype, shape, data) = EXT_NDARRAY, _raw_bytes_numpy(obj)
        elif isinstance(obj, torch.Tensor):
            code, (dtype, shape, data) = EXT_TENSOR, _raw_bytes_tensor(obj)
        elif isinstance(obj, np.generic):
            return obj.item()
        else:
            raise TypeError(f"cannot encode an object of type {type(obj).__qualname__}"
                                      f" (only msgspec types, numpy arrays and CPU tensors)")
        frames = self._frames
        if frames is not None and data.nbytes >= self.oob_threshold:
            frames.append(memoryview(data))
            header = _header_encoder.encode((dtype, shape, len(frames) - 1))
            return msgspec.msgpack.Ext(code, bytes((len(header),)) + header)
        header = _header_encoder.encode((dtype, shape, -1))
        if len(header) > 255:
            raise TypeError(f"array of {len(shape)} dimensions is too deep to encode")
        return msgspec.msgpack.Ext(code, b"".join((bytes((len(header),)), header, data.data)))


class MsgpackDecoder:
    """Decodes frames into `type` (Any: msgpack types plus arrays and tensors).

    Not thread-safe: one decoder per receiving thread. Decoded arrays may share memory with the
    frames they came from: hand the decoder buffers it may keep (not a shared-memory view).
    """

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._frames: Sequence[Buffer] = ()

    def decode(self, frames: Buffer | msgspec.Raw | Sequence[Buffer | msgspec.Raw]) -> Any:
        if isinstance(frames, (bytes, bytearray, memoryview, msgspec.Raw)):
            frames = (frames,)
        return self.decode_frames(frames)

    def decode_frames(self, frames: Sequence[Buffer | msgspec.Raw]) -> Any:
        """`decode` of a message already split into frames (body first)."""
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_NDARRAY, EXT_TENSOR):
            raise ValueError(f"unknown msgpack extension type {code}")
        hlen = data[0]
        dtype, shape, frame = _header_decoder.decode(data[1:1 + hlen])
        inline = frame < 0
        raw = memoryview(data[1 + hlen:] if inline else self._frames[frame]).cast("B")
        if code == EXT_NDARRAY:
            arr = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
            # Small inline arrays sit unaligned inside the body: copy them (cheap).
            return arr.copy() if inline or raw.readonly else arr
        dt = _TORCH_DTYPES[dtype]
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dt)
        if inline or raw.readonly:
            raw = memoryview(bytearray(raw))
        t = torch.frombuffer(raw, dtype=dt, count=numel).view(shape)
        return t.clone() if t.data_ptr() % t.element_size() else t


def _dec_hook(type: Any, obj: Any) -> Any:
    if type in (np.ndarray, torch.Tensor) and isinstance(obj, type):
        return obj
    raise NotImplementedError(f"cannot decode {type!r} from {obj.__class__.__name__}")


# ----------------------------------------------------------------------------------------------
# RPC envelopes, and a worker's start-up message


class Ready(msgspec.Struct, array_like=True, frozen=True):
    """A worker's start-up report over its ready pipe: its reply queue, or the traceback."""

    rank: int
    pid: int
    response: ShmQueueHandle | None = None
    error: str | None = None


class RemoteError(msgspec.Struct, array_like=True, frozen=True):
    type_module: str
    type_name: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, error: BaseException, traceback_text: str) -> RemoteError:
        return cls(type(error).__module__, type(error).__qualname__, str(error), traceback_text)

    def to_exception(self, rank: int | None = None) -> BaseException:
        """The same exception type when this process has it (with the message), else a
        `WorkerError`; the remote traceback is attached either way."""
        error: BaseException | None = None
        cls: Any = sys.modules.get(self.type_module)
        for part in self.type_name.split("."):
            cls = getattr(cls, part, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                error = cls(self.message)
            except Exception:  # a constructor that does not take one message
                error = None
        if error is None:
            error = WorkerError(f"{self.type_module}.{self.type_name}: {self.message}",
                                rank=rank, exc_type=self.type_name,
                                remote_traceback=self.traceback)
        error.remote_traceback = self.traceback
        if hasattr(error, "add_note"):
            error.add_note(f"raised in worker rank {rank}; remote traceback:\n{self.traceback}")
        return error


class RPCCall(msgspec.Struct, array_like=True, frozen=True):
    """Sent to every worker. `reply_rank`: ALL_RANKS, or the only rank that replies."""

    call_id: int
    method: str
    args: Any = ()
    reply_rank: int = ALL_RANKS
    # A pickled callable run as fn(worker, *args): collective_rpc(callable) only, never a step.
    function: bytes | None = None


class RPCReply(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    rank: int
    result: Any = None
    error: RemoteError | None = None


class _RPCCallWire(msgspec.Struct, array_like=True, frozen=True):
    """`RPCCall` as received: args left encoded until the method (and its types) is known."""

    call_id: int
    method: str
    args: msgspec.Raw
    reply_rank: int = ALL_RANKS
    function: bytes | None = None


class _RPCReplyWire(msgspec.Struct, array_like=True, frozen=True):
    call_id: int
    rank: int
    result: msgspec.Raw
    error: RemoteError | None = None


def _array_len(raw: Buffer) -> int:
    """Length of the msgpack array that `raw` starts with."""
    mv = memoryview(raw).cast("B")
    head = mv[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(mv[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(mv[1:5], "big")
    raise ValueError(f"RPC arguments are not a msgpack array (first byte 0x{head:02x})")


class MethodTypes:
    """Per-method argument and result decoders for the public methods of `target`, built from
    type hints (unannotated or unknown: Any) and cached."""

    def __init__(self, target: type | None) -> None:
        self.target = target
        self._args: dict[tuple[str, int], MsgpackDecoder] = {}
        # (method, first byte of the encoded arguments) -> decoder: the first byte of a
        # msgpack array of up to 15 items is its length, so a step's arguments pick their
        # decoder with one lookup (longer arrays fall back to `args_decoder`).
        self._args_by_head: dict[tuple[str, int], MsgpackDecoder] = {}
        self._results: dict[str, MsgpackDecoder] = {}
        self._any = MsgpackDecoder()

    def _hints(self, method: str) -> tuple[list[Any], Any]:
        func = getattr(self.target, method, None) if self.target is not None else None
        if func is None or method.startswith("_") or not callable(func):
            return [], Any
        try:
            hints = typing.get_type_hints(func)
            params = list(inspect.signature(func).parameters.values())[1:]
        except Exception:
            return [], Any
        positional = [hints.get(p.name, Any) for p in params
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return positional, hints.get("return", Any)

    def args_decoder(self, method: str, num_args: int) -> MsgpackDecoder:
        key = (method, num_args)
        if key not in self._args:
            positional, _ = self._hints(method)
            types = [positional[i] if i < len(positional) else Any for i in range(num_args)]
            self._args[key] = MsgpackDecoder(tuple[tuple(types)] if types else tuple[()])
        return self._args[key]

    def result_decoder(self, method: str | None) -> MsgpackDecoder:
        if method is None:
            return self._any
        if method not in self._results:
            # A method that may answer with a Deferred delivers its resolved value.
            self._results[method] = MsgpackDecoder(resolved_type(self._hints(method)[1]))
        return self._results[method]

    @staticmethod
    def decode_call(frames: Sequence[Buffer]) -> _RPCCallWire:
        """The envelope only; `decode_args` decodes the arguments once the method is known."""
        return _CALL_DECODER.decode(frames[0])

    def decode_args(self, call: _RPCCallWire, frames: Sequence[Buffer]) -> tuple:
        raw_args = (call.args,) if len(frames) == 1 else [call.args, *frames[1:]]
        if call.function is not None:
            return tuple(self._any.decode(raw_args))
        key = (call.method, memoryview(call.args)[0])
        decoder = self._args_by_head.get(key)
        if decoder is None:
            decoder = self.args_decoder(call.method, _array_len(call.args))
            if 0x90 <= key[1] <= 0x9F:  # fixarray: the byte is the length
                self._args_by_head[key] = decoder
        return decoder.decode_frames(raw_args)

    def decode_reply(self, frames: Sequence[Buffer], method: str | None
                     ) -> tuple[_RPCReplyWire, Any]:
        """The reply and its result, decoded as `method`'s return type (None: Any)."""
        reply = _REPLY_DECODER.decode(frames[0])
        if reply.error is not None:
            return reply, None
        decoder = self._results.get(method) if method is not None else None
        if decoder is None:
            decoder = self.result_decoder(method)
        return reply, decoder.decode_frames(
            (reply.result,) if len(frames) == 1 else [reply.result, *frames[1:]])


_CALL_DECODER = msgspec.msgpack.Decoder(_RPCCallWire)
_REPLY_DECODER = msgspec.msgpack.Decoder(_RPCReplyWire)
