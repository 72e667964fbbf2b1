"""Reasoning parsers: split a thinking model's output into its reasoning (``<think>`` ...
``</think>``) and the content that follows, whole or while it streams (vLLM's
``--reasoning-parser``; the same field values).

Both parsers follow vLLM's current rules (the chat templates of DeepSeek-R1 and of recent Qwen3
put ``<think>`` in the prompt, so the output usually holds only ``</think>``):

- everything before the first ``</think>`` is reasoning, everything after it content (None when
  empty); with no ``</think>`` at all (output cut short, or the model never closed its
  thinking) the whole output is reasoning and the content None;
- a ``<think>`` the model writes itself before ``</think>`` is removed (the first one only;
  text before it stays reasoning, as vLLM's streaming has it, where vLLM's whole-output parse
  drops it); ``</think>`` is removed; newlines around the markers are kept as the model wrote them
  (``"<think>\\nA\\n</think>\\n\\nB"`` -> reasoning ``"\\nA\\n"``, content ``"\\n\\nB"``);
- "qwen3" with ``enable_thinking: False`` in the chat template kwargs: the whole output is
  content (the template closed the thinking in the prompt).

Streaming invariant: the reasoning pieces of all deltas (and of `finish_reasoning_streaming`),
concatenated, equal the non-streaming reasoning (``""`` standing for None), and likewise the
content pieces, however the output is cut into chunks; a marker split across chunks is held
back until it is decided, so no piece of a marker ever goes out.

The token-level half (`is_reasoning_end`, `end_token_id`) is what structured output needs to
know when the reasoning is over; it reads the marker ids from the tokenizer's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mrv2.entrypoints.openai.partial_marker import partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """``<think>`` / ``</think>`` reasoning; one instance per request (it keeps the streaming
    state). `tokenizer` may be None: the text methods do not need it, and the token ids are
    then None."""

    start_token = THINK_START
    end_token = THINK_END

    def __init__(self, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        self.start_token_id: int | None = vocab.get(self.start_token)
        self.end_token_id: int | None = vocab.get(self.end_token)
        self.thinking_enabled = True
        self._state = "reasoning"  # reasoning | content
        self._start_seen = False  # a <think> in the output was removed already
        self._held = ""  # a possible marker start, undecided

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning is over at the end of `token_ids` (a prompt, or prompt and
        output): the last think marker among them is ``</think>``."""
        for token in reversed(token_ids):
            if token == self.start_token_id and token is not None:
                return False
            if token == self.end_token_id and token is not None:
                return True
        return False

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        if not self.thinking_enabled:
            return None, model_output
        end = model_output.find(self.end_token)
        reasoning = model_output if end < 0 else model_output[:end]
        start = reasoning.find(self.start_token)
        if start >= 0:
            reasoning = reasoning[:start] + reasoning[start + len(self.start_token):]
        if end < 0:
            return reasoning, None
        return reasoning, model_output[end + len(self.end_token):] or None

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str) -> tuple[str | None, str | None]:
        """(reasoning piece, content piece) that `delta_text` adds (None for an empty piece);
        `current_text` = `previous_text` + `delta_text`."""
        if not self.thinking_enabled or self._state == "content":
            return None, delta_text or None
        text, self._held = self._held + delta_text, ""
        reasoning = []
        if not self._start_seen:
            start, end = text.find(self.start_token), text.find(self.end_token)
            if start >= 0 and (end < 0 or start < end):
                reasoning.append(text[:start])
                text = text[start + len(self.start_token):]
                self._start_seen = True
        end = text.find(self.end_token)
        if end >= 0:
            reasoning.append(text[:end])
            self._state = "content"
            return "".join(reasoning) or None, text[end + len(self.end_token):] or None
        markers = (self.end_token,) if self._start_seen else (self.end_token, self.start_token)
        keep = partial_marker_len(text, *markers)
        reasoning.append(text[:len(text) - keep])
        self._held = text[len(text) - keep:]
        return "".join(reasoning) or None, None

    def finish_reasoning_streaming(self) -> tuple[str | None, str | None]:
        """At the end of the output: the held-back text, which no marker completed (reasoning)."""
        held, self._held = self._held, ""
        return held or None, None


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the template ends the prompt with ``<think>\\n``, so
    the text before ``</think>`` is reasoning even without a ``<think>`` in the output."""


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: as DeepSeek-R1, plus the ``enable_thinking`` switch of its chat template
    (default on); off, the output is all content."""

    def __init__(self, tokenizer: Any = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.thinking_enabled = bool((chat_template_kwargs or {}).get("enable_thinking", True))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; ValueError naming the valid ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; valid names: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
