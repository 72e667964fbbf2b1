"""Llama 3.x JSON tool calls (vLLM's "llama3_json"): the output is, after optional whitespace
and an optional ``<|python_tag|>``, one or more call objects separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ..., "arguments": {...}}

The arguments are under "arguments", else "parameters", re-serialised with
json.dumps(..., ensure_ascii=False). When tools are called the content is None and text after
the last call is dropped; output that does not start with an object, or whose first object is
not a call, is plain content. A later object that is cut off ends the list (the calls before it
stand); one that is complete JSON but not a call makes the whole output content, as in vLLM.
"""

from __future__ import annotations

import json
import re

from mrv2.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, StreamOut
from mrv2.entrypoints.openai.tool_parsers.call_stream import JsonCallsParser, tool_call_from_json

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = re.compile(r"\s*;\s*(?=\{)")


def _calls_text(model_output: str) -> str | None:
    """The output from its first call object on, or None when it does not start with one."""
    text = model_output.lstrip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    return text if text.startswith("{") else None


class Llama3JsonToolParser(JsonCallsParser):
    """Streaming: leading whitespace and ``<|python_tag|>`` are held back until the first other
    character decides between tool calls (``{``) and content; the first object's text is held
    until its name is known to be a call's (or the object turns out not to be one)."""

    arg_keys = ("arguments", "parameters")

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        text = _calls_text(model_output)
        if text is None:
            return ExtractedToolCalls(tools_called=False, content=model_output)
        decoder, pos, calls = json.JSONDecoder(), 0, []
        while True:
            try:
                obj, end = decoder.raw_decode(text, pos)
            except ValueError:
                if not calls:
                    return ExtractedToolCalls(tools_called=False, content=model_output)
                break  # a later object cut off: the calls before it stand
            try:
                calls.append(tool_call_from_json(obj, self.arg_keys))
            except (KeyError, TypeError, ValueError):
                return ExtractedToolCalls(tools_called=False, content=model_output)
            sep = _SEPARATOR.match(text, end)
            if sep is None:
                break
            pos = sep.end()
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=None)

    def _step(self, text: str, out: StreamOut) -> None:
        while True:
            if self._mode == "text":
                calls = _calls_text(text)
                if calls is None:
                    stripped = text.lstrip()
                    after_tag = stripped[len(PYTHON_TAG):] if stripped.startswith(PYTHON_TAG) \
                        else None
                    if PYTHON_TAG.startswith(stripped) or (after_tag is not None
                                                           and not after_tag.strip()):
                        self._buf = text  # whitespace or a partial tag: undecided
                    else:
                        out.content.append(text)
                        self._mode = "raw"
                    return
                self._start_call(text)
                text = calls
            elif self._mode == "call":
                rest = self._feed_call(text, out)
                if rest is None:
                    return
                text, self._mode = rest, "separator"
            else:  # "separator": `;` then the next object, else the list has ended
                stripped = text.lstrip()
                after = stripped[1:].lstrip()
                if stripped[:1] == ";" and after[:1] == "{":
                    self._start_call(after)
                    text = after
                elif not stripped or (stripped[0] == ";" and not after):
                    self._buf = text
                    return
                else:
                    self._mode = "dead"
                    return
