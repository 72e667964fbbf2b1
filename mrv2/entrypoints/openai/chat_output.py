"""One chat choice's generated text -> the assistant message, whole or as streamed deltas.

Two stages, each optional: the reasoning (`--reasoning-parser`) is split off first; the rest is
content, from which tool calls are taken according to the request's tool_choice:

- "auto": the server's `--tool-call-parser` (needs `--enable-auto-tool-choice`);
- "required": the grammar made the text a JSON array of {"name", "parameters"} (vLLM's);
- a named function: the grammar made the whole text that function's arguments;
- "none" (or no tools): plain content.

Invariant (as for the parsers it drives): the pieces of every streamed delta, concatenated per
field, equal the whole message's fields; tool-call deltas follow the OpenAI shape (a call's
first delta has index, id, type and name; later ones only index and an arguments piece).
"""

from __future__ import annotations

import json
from typing import Any

from mrv2.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from mrv2.entrypoints.openai.reasoning_parsers import ReasoningParser
from mrv2.entrypoints.openai.tool_parsers.base import (DeltaFunctionCall, DeltaToolCall,
                                                       FunctionCall, ToolCall, ToolParser,
                                                       random_tool_call_id)


class ChatChoiceParser:
    def __init__(self, request: ChatCompletionRequest,
                 reasoning_parser: ReasoningParser | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        choice = request.effective_tool_choice
        self.named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        self.required = choice == "required"
        # "auto" parses only with a parser; the server refuses "auto" with tools without one.
        self.tool_parser = tool_parser if choice == "auto" and request.tools else None
        self.reasoning_parser = reasoning_parser
        self._text = ""  # all generated text so far
        self._content = ""  # its content part (after the reasoning)
        self._required = _RequiredCallsStream() if self.required else None
        self._named_started = False

    @property
    def makes_tool_calls(self) -> bool:
        return bool(self.named or self.required or self.tool_parser)

    # -- whole output ---------------------------------------------------------------------

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message's fields beyond role, whether it called tools)."""
        reasoning, content = None, text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)
        calls: list[ToolCall] = []
        if self.named is not None:
            calls = [ToolCall(function=FunctionCall(name=self.named, arguments=content or ""))]
            content = None
        elif self.required:
            calls = _required_calls(content or "")
            if calls:
                content = None
        elif self.tool_parser is not None and content:
            extracted = self.tool_parser.extract_tool_calls(content)
            if extracted.tools_called:
                calls, content = extracted.tool_calls, extracted.content
        message = {"content": content, "reasoning": reasoning,
                   "tool_calls": [c.model_dump() for c in calls]}
        return message, bool(calls)

    # -- streaming ------------------------------------------------------------------------

    def delta(self, delta_text: str) -> dict[str, Any] | None:
        """The message delta that `delta_text` (the next piece of the output) adds."""
        previous, self._text = self._text, self._text + delta_text
        reasoning, content = None, delta_text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning_streaming(
                previous, self._text, delta_text)
        return self._delta(reasoning, content or "", final=False)

    def finish(self) -> dict[str, Any] | None:
        """What the parsers held back (a possible marker), at the end of the output."""
        reasoning, content = None, ""
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.finish_reasoning_streaming()
        return self._delta(reasoning, content or "", final=True)

    def _delta(self, reasoning: str | None, content: str, final: bool) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning"] = reasoning
        previous, self._content = self._content, self._content + content
        calls: list[DeltaToolCall] = []
        if self.named is not None:
            if content or (final and not self._named_started):
                if not self._named_started:
                    self._named_started = True
                    calls.append(DeltaToolCall(index=0, id=random_tool_call_id(),
                                               type="function",
                                               function=DeltaFunctionCall(name=self.named,
                                                                          arguments="")))
                if content:
                    calls.append(DeltaToolCall(index=0,
                                               function=DeltaFunctionCall(arguments=content)))
        elif self._required is not None:
            calls = self._required.feed(content)
        elif self.tool_parser is not None:
            pieces = [self.tool_parser.extract_tool_calls_streaming(previous, self._content,
                                                                    content) if content else None]
            if final:
                pieces.append(self.tool_parser.finish_streaming())
            text = "".join(p.content for p in pieces if p is not None and p.content)
            calls = [c for p in pieces if p is not None for c in p.tool_calls]
            if text:
                out["content"] = text
        elif content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in calls]
        return out or None


def _required_calls(text: str) -> list[ToolCall]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short (length): the text goes out as content
    return [ToolCall(function=FunctionCall(
        name=item["name"], arguments=json.dumps(item["parameters"], ensure_ascii=False)))
        for item in items]


class _RequiredCallsStream:
    """tool_choice "required" while streaming: the text is a JSON array of calls; each call is
    sent once its object is complete (its name, then its arguments in one piece)."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where the next array element (or its separator) starts
        self._count = 0
        self._decoder = json.JSONDecoder()

    def feed(self, content: str) -> list[DeltaToolCall]:
        self._text += content
        calls: list[DeltaToolCall] = []
        while True:
            start = self._pos
            while start < len(self._text) and self._text[start] in " \t\r\n[,":
                start += 1
            if start >= len(self._text) or self._text[start] != "{":
                return calls
            try:
                item, end = self._decoder.raw_decode(self._text, start)
            except json.JSONDecodeError:
                return calls  # the object is not complete yet
            self._pos = end
            index, self._count = self._count, self._count + 1
            arguments = json.dumps(item["parameters"], ensure_ascii=False)
            calls.append(DeltaToolCall(index=index, id=random_tool_call_id(), type="function",
                                       function=DeltaFunctionCall(name=item["name"],
                                                                  arguments="")))
            calls.append(DeltaToolCall(index=index,
                                       function=DeltaFunctionCall(arguments=arguments)))
