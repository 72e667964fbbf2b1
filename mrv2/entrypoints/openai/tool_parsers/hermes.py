"""Hermes-style tool calls, as Qwen2.5 / Qwen3 / SmolLM2 / Hermes models write them:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>

As vLLM's "hermes" parser: the content is the text before the first ``<tool_call>`` (None when
empty); text between and after the blocks is dropped; a last block may lack its
``</tool_call>``; arguments are re-serialised with json.dumps(..., ensure_ascii=False); any
block that is not such a JSON object makes the whole output plain content.
"""

from __future__ import annotations

import json
import re

from mrv2.entrypoints.openai.partial_marker import partial_marker_len
from mrv2.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, StreamOut
from mrv2.entrypoints.openai.tool_parsers.call_stream import JsonCallsParser, tool_call_from_json

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesToolParser(JsonCallsParser):
    """Streaming: content streams until ``<tool_call>`` (a partial marker at the end of the text
    seen so far is held back); each call's name goes out once its JSON string is complete, then
    its arguments in pieces as they arrive."""

    arg_keys = ("arguments",)

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if TOOL_CALL_START not in model_output:
            return ExtractedToolCalls(tools_called=False, content=model_output)
        try:
            calls = [tool_call_from_json(json.loads(closed or unclosed), self.arg_keys)
                     for closed, unclosed in _BLOCK.findall(model_output)]
        except (KeyError, TypeError, ValueError):
            return ExtractedToolCalls(tools_called=False, content=model_output)
        content = model_output[:model_output.find(TOOL_CALL_START)]
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=content or None)

    def _step(self, text: str, out: StreamOut) -> None:
        while True:
            if self._mode in ("text", "between"):
                at = text.find(TOOL_CALL_START)
                if at < 0:
                    keep = partial_marker_len(text, TOOL_CALL_START)
                    if self._mode == "text":  # before the first call: content
                        out.content.append(text[:len(text) - keep])
                    self._buf = text[len(text) - keep:]
                    return
                if self._mode == "text":
                    out.content.append(text[:at])
                self._start_call(text[at:])
                text = text[at + len(TOOL_CALL_START):]
            elif self._mode == "call":
                rest = self._feed_call(text, out)
                if rest is None:
                    return
                text, self._mode = rest, "close"
            else:  # "close": only whitespace may come between the object and </tool_call>
                stripped = text.lstrip()
                if stripped.startswith(TOOL_CALL_END):
                    text, self._mode = stripped[len(TOOL_CALL_END):], "between"
                elif TOOL_CALL_END.startswith(stripped):
                    self._buf = text
                    return
                else:
                    self._fail(out)
                    return
