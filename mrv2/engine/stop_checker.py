"""The text of one completion as the user sees it: decoded, cut at a stop string, held back.

`CompletionText` feeds a request's new token ids through its incremental detokenizer, looks
for stop strings in the new text (vLLM semantics), and hands out text for streaming:

- A stop string ends the completion: the text is cut before it (or after it, with
  `include_stop_str_in_output`), the finish reason is "stop" and the stop reason is the string.
  Text after the stop string is never handed out.
- A stop token (EOS or one of `stop_token_ids`) is not detokenized unless
  `include_stop_str_in_output` is set.
- Stop strings are not looked for in the text of the first `min_tokens` tokens.
- While streaming, the longest tail of the text that could still grow into a stop string (at
  most `max(len(stop)) - 1` characters) is held back, so no prefix of a stop string that later
  matches is ever shown. Handed-out text only ever grows: each cumulative text is a prefix of
  the next, and of the final one.
- Without stop strings and with FINAL_ONLY outputs nothing is needed before the end, so the ids
  are decoded once, when the request finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.sampling_params import SamplingParams


def find_stop_string(text: str, new_char_count: int, stop: Sequence[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that occurs first in `text` ending within its last `new_char_count`
    characters (ties: the first in `stop`), and the length to cut the text to."""
    if not new_char_count or not stop:
        return None
    best: tuple[str, int] | None = None
    for stop_str in stop:
        # Only occurrences that end in the new text: older ones were searched before.
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop_str, index)
    if best is None:
        return None
    stop_str, index = best
    return stop_str, index + len(stop_str) if include_in_output else index


def stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    hold = 0
    for stop_str in stop:
        for k in range(min(len(stop_str) - 1, len(text)), hold, -1):
            if text.endswith(stop_str[:k]):
                hold = k
                break
    return hold


class CompletionText:
    def __init__(self, detokenizer: IncrementalDetokenizer, params: SamplingParams,
                 streaming: bool) -> None:
        self.detokenizer = detokenizer
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Hold back while streaming; included stop strings are shown anyway, so no need then.
        self.hold_back = streaming and bool(self.stop) and not self.include_stop_str_in_output
        self.lazy = not streaming and not self.stop
        self.text = ""
        self.num_tokens = 0  # all output tokens seen, stop tokens included
        self._pending: list[int] = []  # lazy mode: ids not decoded yet
        self._sent = 0  # characters of `text` handed out so far

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool,
               finished: bool) -> str | None:
        """Take a step's new ids. Returns the stop string that ended the completion, if any.

        `stop_terminated`: the engine core stopped at a stop token, the last of these ids.
        `finished`: the engine core finished the request (no more ids will come).
        """
        ids = list(new_token_ids)
        num_before = self.num_tokens
        self.num_tokens += len(ids)
        if stop_terminated and ids and not self.include_stop_str_in_output:
            ids.pop()  # the stop token's text is not part of the output
        detokenizer = self.detokenizer
        if self.lazy:
            self._pending.extend(ids)
            if finished:
                self.text += detokenizer.decode(self._pending) + detokenizer.flush()
                self._pending = []
            return None
        # Text of the first min_tokens tokens is decoded but not searched for stop strings.
        unsearched = min(len(ids), max(0, self.min_tokens - num_before))
        if unsearched:
            self.text += detokenizer.decode(ids[:unsearched])
        search_from = len(self.text)
        self.text += detokenizer.decode(ids[unsearched:])
        if finished:
            self.text += detokenizer.flush()
        if not self.stop or self.num_tokens <= self.min_tokens:
            return None
        found = find_stop_string(self.text, len(self.text) - search_from, self.stop,
                                 self.include_stop_str_in_output)
        if found is None:
            return None
        stop_str, cut = found
        # Hold-back guarantees the cut is past everything handed out; never unsend text.
        self.text = self.text[:max(cut, self._sent)]
        return stop_str

    def next_text(self, finished: bool, delta: bool) -> str:
        """Text to hand out now: everything new (`delta`) or everything so far."""
        end = len(self.text)
        if not finished and self.hold_back:
            end = max(self._sent, end - stop_prefix_length(self.text, self.stop))
        start = self._sent if delta else 0
        self._sent = end
        return self.text[start:end]
