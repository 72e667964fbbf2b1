"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``): one call read
while it streams, and the base of the parsers whose calls have that shape.
"""

from __future__ import annotations

import json
from typing import Any

from mrv2.entrypoints.openai.tool_parsers.base import (DeltaFunctionCall, DeltaToolCall,
                                                       FunctionCall, StreamDelta, StreamOut,
                                                       ToolCall, ToolParser, random_tool_call_id)
from mrv2.entrypoints.openai.tool_parsers.json_stream import JsonCanonicalizer


def tool_call_from_json(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall:
    """The call a parsed JSON object names, its arguments under the first of `arg_keys` it has
    (re-serialised with json.dumps(..., ensure_ascii=False), as vLLM does). Raises KeyError,
    TypeError or ValueError when `obj` is not such an object."""
    if not isinstance(obj, dict):
        raise TypeError(f"a tool call is a JSON object, not {type(obj).__name__}")
    key = next((k for k in arg_keys if k in obj), arg_keys[0])
    return ToolCall(function=FunctionCall(name=obj["name"],
                                          arguments=json.dumps(obj[key], ensure_ascii=False)))


class CallStream:
    """One call's JSON object, fed as it streams.

    The deltas it produces follow the ToolParser contract: the first (once the name is complete
    and the arguments have begun, so an object without arguments never sends a name) has id,
    type and name, and the arguments available by then; later ones add argument pieces.
    The pieces, concatenated, are always a prefix of the final arguments string and equal it
    once the object is complete (`call` is then the parsed ToolCall). `failed`: the text is not
    a call (not JSON, no string name, no arguments).
    """

    def __init__(self, index: int, arg_keys: tuple[str, ...]) -> None:
        self.index = index
        self.arg_keys = arg_keys
        self.call: ToolCall | None = None
        self.failed = False
        self.name_sent = False
        self._json = JsonCanonicalizer()
        self._raw: list[str] = []
        self._args_key: str | None = None
        self._args_next = 0  # first part of the arguments not handed out yet
        self._sent: list[str] = []

    @property
    def complete(self) -> bool:
        return self.call is not None

    def feed(self, text: str, out: StreamOut) -> int:
        """Reads `text` into the call, adding its deltas to `out`; returns the characters used
        (fewer than `text` once the object has closed)."""
        used = self._json.feed(text)
        self._raw.append(text[:used])
        if self._json.error:
            self.failed = True
            return used
        spans = self._json.spans
        if self._args_key is None:
            self._args_key = next((k for k in self.arg_keys if k in spans), None)
        if not self.name_sent:
            name = self._name()
            if self.failed:
                return used
            if name is not None and self._args_key is not None:  # a call's, once arguments begin
                self.name_sent = True
                out.tool_calls.append(DeltaToolCall(
                    index=self.index, id=random_tool_call_id(), type="function",
                    function=DeltaFunctionCall(name=name, arguments=self._new_arguments())))
        elif self._args_key is not None:
            out.add_arguments(self.index, self._new_arguments())
        if self._json.done:
            self._finish(out)
        return used

    def _name(self) -> str | None:
        """The name once its JSON string is complete; a name that is not a string fails."""
        span = self._json.spans.get("name")
        if span is None or span[1] is None:
            return None
        name = json.loads("".join(self._json.parts[span[0]:span[1]]))
        if not isinstance(name, str):
            self.failed = True
            return None
        return name

    def _new_arguments(self) -> str:
        if self._args_key is None:
            return ""
        start, end = self._json.spans[self._args_key]
        end = len(self._json.parts) if end is None else end
        piece = "".join(self._json.parts[max(start, self._args_next):end])
        self._args_next = end
        self._sent.append(piece)
        return piece

    def _finish(self, out: StreamOut) -> None:
        try:
            call = tool_call_from_json(json.loads("".join(self._raw)), self.arg_keys)
        except (KeyError, TypeError, ValueError):
            self.failed = True
            return
        sent, final = "".join(self._sent), call.function.arguments
        if final.startswith(sent):  # only a repeated key makes it differ
            out.add_arguments(self.index, final[len(sent):])
        self.call = call


class JsonCallsParser(ToolParser):
    """A parser whose calls are JSON objects: it keeps the call being streamed, and whether any
    tool-call delta went out (after that, malformed text can no longer turn back into content).
    """

    arg_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._calls: list[CallStream] = []
        self._tail: list[str] | None = None  # text since the first call began, while unsent
        self._mode = "text"
        self._buf = ""  # held-back text, read again with the next delta

    def _start_call(self, tail: str) -> None:
        if not self._calls:
            self._tail = [tail]
        self._calls.append(CallStream(len(self._calls), self.arg_keys))
        self._mode = "call"

    def _feed_call(self, text: str, out: StreamOut) -> str | None:
        """Feeds the current call; the text after it once it is complete, else None (then
        `_mode` says why: still "call", or "raw" / "dead" after a malformed call)."""
        call = self._calls[-1]
        used = call.feed(text, out)
        if call.name_sent:
            self._tail = None
        if call.failed:
            self._fail(out)
            return None
        return text[used:] if call.complete else None

    def _fail(self, out: StreamOut) -> None:
        """Malformed call text: all of it is content when no call has been sent yet (as the
        non-streaming result then is), else the stream's tool calls end here."""
        if self._tail is not None:
            out.content.extend(self._tail)
            self._tail = None
            self._mode = "raw"
        else:
            self._mode = "dead"

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> StreamDelta | None:
        out = StreamOut()
        if self._tail is not None:
            self._tail.append(delta_text)
        text, self._buf = self._buf + delta_text, ""
        if self._mode == "raw":
            out.content.append(text)
        elif self._mode != "dead":
            self._step(text, out)
        return out.delta()

    def _step(self, text: str, out: StreamOut) -> None:
        raise NotImplementedError

    def finish_streaming(self) -> StreamDelta | None:
        out = StreamOut()
        if self._mode == "text":
            out.content.append(self._buf)
        elif self._tail is not None:  # the first call never completed: the whole is content
            out.content.extend(self._tail)
        self._tail, self._buf, self._mode = None, "", "dead"
        return out.delta()
