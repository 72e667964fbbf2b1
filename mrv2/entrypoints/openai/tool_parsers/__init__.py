"""Tool-call parsers: model output text -> OpenAI tool calls, whole or streamed (the contract
is in `base`). `get_tool_parser(name)` gives the class the server's ``--tool-call-parser``
names; construct one per request with the tokenizer."""

from __future__ import annotations

from mrv2.entrypoints.openai.tool_parsers.base import ToolParser
from mrv2.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from mrv2.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError naming the valid ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; valid names: "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None
