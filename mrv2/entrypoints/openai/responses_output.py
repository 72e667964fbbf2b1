"""A response's output items, built from the chat route's message deltas (ChatChoiceParser's
`delta` / `finish` while streaming, or its whole `message` at once), with the stream events
that build them.

Items follow the order the pieces arrive in: reasoning (with --reasoning-parser) becomes a
`reasoning` item, content a `message` item with one `output_text` part, each tool call a
`function_call` item. A piece of another kind closes the open item (its `.done` events go out)
and opens the next (`response.output_item.added`, then `response.content_part.added` for a
message or reasoning). The events carry no `sequence_number`: the stream numbers them as it
sends them. Every item closed before the end is "completed"; the last one gets the response's
status ("incomplete" when max_output_tokens cut it short).

The event models below document /openapi.json only, like the other response models.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, RootModel

from mrv2.entrypoints.openai.answer_schemas import ErrorInfo
from mrv2.entrypoints.openai.responses_protocol import (OutputItem, OutputText, ReasoningText,
                                                        ResponsesResponse)

Event = dict[str, Any]
_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}


def new_id(prefix: str) -> str:
    """OpenAI's id style: a type prefix, an underscore, random hex (resp_, msg_, fc_, rs_)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # a tool call's index -> its item
        self._index: dict[str, int] = {}  # an item's id -> its output_index

    def feed(self, delta: dict[str, Any] | None) -> list[Event]:
        """The events one message delta ({"reasoning", "content", "tool_calls"}, each optional;
        tool calls in the chat stream's shape: a call's first delta has its id and name, later
        ones only argument pieces) adds."""
        events: list[Event] = []
        if not delta:
            return events
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._call(call)
        return events

    def close(self, status: str) -> list[Event]:
        """The events that finish the open item, which gets `status`."""
        return self._close(status)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _add(self, item: dict[str, Any]) -> Event:
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        self._open = item
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": copy.deepcopy(item)}

    def _text(self, kind: str, piece: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "message":
                item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            events.append(self._add(item))
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(item),
                           "content_index": 0, "part": copy.deepcopy(part)})
        item = self._open
        item["content"][0]["text"] += piece
        event = {"type": _DELTA[kind], **self._where(item), "content_index": 0, "delta": piece}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        if call.get("id") is not None:  # a new call
            events += self._close("completed")
            item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                    "name": function.get("name") or "", "arguments": "",
                    "status": "in_progress"}
            self._calls[call["index"]] = item
            events.append(self._add(item))
        # The parsers stream calls one after another: a piece is always the open call's.
        item = self._calls[call["index"]]
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta",
                           **self._where(item), "delta": piece})
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **where,
                       "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = {"type": _DONE[item["type"]], **where, "content_index": 0,
                    "text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0,
                             "part": copy.deepcopy(part)}]
        events.append({"type": "response.output_item.done",
                       "output_index": where["output_index"], "item": copy.deepcopy(item)})
        return events


def whole_message_delta(message: dict[str, Any]) -> dict[str, Any]:
    """ChatChoiceParser.message's fields as one delta (its tool calls given their index)."""
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
    return {"reasoning": message.get("reasoning"), "content": message.get("content"),
            "tool_calls": calls}


def reasoning_token_count(items: list[dict[str, Any]], token_ids: list[int],
                          end_token_id: int | None, count: Callable[[str], int]) -> int:
    """Output tokens spent on reasoning: those before the reasoning's end marker when it is
    one token of the output, else the reasoning text's length in tokens (`count`)."""
    reasoning = "".join(part["text"] for item in items if item["type"] == "reasoning"
                        for part in item["content"])
    if not reasoning:
        return 0
    if end_token_id is not None and end_token_id in token_ids:
        return token_ids.index(end_token_id)
    return min(len(token_ids), count(reasoning))


# -- the stream's events (documentation) -----------------------------------------------------

class _Event(BaseModel):
    sequence_number: int


class _ItemEvent(_Event):
    item_id: str
    output_index: int


class LifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed"]
    response: ResponsesResponse


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(_ItemEvent):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] | None = Field(None, description="output_text only")


class TextDoneEvent(_ItemEvent):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] | None = Field(None, description="output_text only")


class ArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str


class ArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    arguments: str


class ErrorEvent(_Event):
    """A failure mid-stream, the stream's last event: OpenAI's fields, and the error envelope
    (which makes the openai client raise)."""

    type: Literal["error"]
    code: str | None
    message: str
    param: str | None
    error: ErrorInfo


class ResponseStreamEvent(RootModel):
    """One server-sent event of a streamed response (`event:` names its type)."""

    root: Annotated[LifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent
                    | TextDoneEvent | ArgumentsDeltaEvent | ArgumentsDoneEvent | ErrorEvent,
                    Field(discriminator="type")]
