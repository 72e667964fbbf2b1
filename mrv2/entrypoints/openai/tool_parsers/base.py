"""What a tool parser returns, in the OpenAI API's shapes (vLLM's field names), and the
interface every tool parser implements.

A parser turns the text a model generated into OpenAI tool calls, either once for the whole
output (`extract_tool_calls`) or chunk by chunk while it streams
(`extract_tool_calls_streaming`, then `finish_streaming` at the end). The two agree:

- the `content` of all stream deltas, concatenated, equals the non-streaming `content`
  (`""` standing for None);
- for each call index, the first `DeltaToolCall` carries `index`, `id`, `type="function"` and
  `function.name` (with `function.arguments`, possibly `""`); every later one carries only
  `index` and a piece of `function.arguments`; the pieces of a call, concatenated, equal the
  non-streaming `ToolCall.function.arguments` exactly.

That holds for every way of cutting the output into chunks, and for output that parses (and
for malformed output rejected before any tool-call delta went out; once a call's name has been
streamed it cannot be taken back, so a call that turns out malformed later ends the stream's
tool calls, where the non-streaming result falls back to plain content).

A parser instance serves one request: its streaming state lives on the instance.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field

from mrv2.entrypoints.openai.protocol import OpenAIBaseModel


def random_tool_call_id() -> str:
    """vLLM's tool-call id: ``chatcmpl-tool-`` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=random_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ExtractedToolCalls(OpenAIBaseModel):
    """A whole output, parsed: `content` is the text outside the calls that goes to the client
    (None when there is none)."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: str | None = None


class StreamDelta(OpenAIBaseModel):
    """What one streamed chunk adds: a piece of content and/or tool-call deltas."""

    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class StreamOut:
    """What one streaming call has produced so far (content pieces and tool-call deltas)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.tool_calls: list[DeltaToolCall] = []

    def add_arguments(self, index: int, piece: str) -> None:
        """A piece of call `index`'s arguments, merged into this chunk's last delta when that
        one is the same call's."""
        if not piece:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index and last.function is not None:
            last.function.arguments = (last.function.arguments or "") + piece
        else:
            self.tool_calls.append(
                DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))

    def delta(self) -> StreamDelta | None:
        content = "".join(self.content)
        if not content and not self.tool_calls:
            return None
        return StreamDelta(content=content or None, tool_calls=self.tool_calls)


class ToolParser:
    """Base of the tool parsers; constructed once per request with the model's HF tokenizer
    (None is fine: these parsers work on text)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The calls in a whole output; malformed output is content (`tools_called` False)."""
        raise NotImplementedError

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> StreamDelta | None:
        """What `delta_text` (the text `current_text` = `previous_text` + `delta_text` added)
        contributes, or None when nothing can go out yet. Text that may be the start of a
        marker is held back until later text decides it; `finish_streaming` hands out what is
        still held when the output ends."""
        raise NotImplementedError

    def finish_streaming(self) -> StreamDelta | None:
        """At the end of the output: what was held back and now counts as content."""
        return None
