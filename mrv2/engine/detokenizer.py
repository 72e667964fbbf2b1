"""Incremental detokenization: token ids in, text deltas out, O(1) work per token.

A byte-level BPE splits one multi-byte UTF-8 character over several tokens, and decoding a
partial character gives U+FFFD. Both implementations therefore hold tokens back while the
decoded window ends with U+FFFD and emit the character once it is whole (vLLM's prefix/read
offset scheme): a '\\ufffd' that is only half a character is never emitted. Only a short window
of ids is decoded each step, never the whole output.

- `FastIncrementalDetokenizer`: tokenizers' Rust `DecodeStream`, for tokenizers backed by
  `tokenizers.Tokenizer` (every transformers "fast" tokenizer).
- `SlowIncrementalDetokenizer`: the same scheme in Python over `tokenizer.decode`, for anything
  else (sentencepiece / pure-Python tokenizers).

Both are primed with a few prompt tokens, so that tokenizers whose decoders depend on context
(SentencePiece's leading "▁") give the first output token its leading space, as vLLM does.
`flush()` returns the text of tokens still held back (a character cut off by the length limit
decodes to U+FFFD, as `tokenizer.decode` would), so that for a byte-level tokenizer all deltas
plus the flush concatenate to `tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from mrv2.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens used as decoding context: the shortest suffix of at least this many ...
_MIN_PROMPT_CONTEXT = 4
# ... and at most this many whose text has no U+FFFD (so it does not end mid-character).
_MAX_PROMPT_CONTEXT = 24
# Ids kept before the held ones when flushing, for context-dependent decoders.
_FLUSH_CONTEXT = 4


class IncrementalDetokenizer:
    """No tokenizer: there is no text. Subclasses implement `decode` and `flush`."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; returns the text they complete (may be empty)."""
        return ""

    def flush(self) -> str:
        """At the end of the request: the text of the tokens still held back."""
        return ""


def make_detokenizer(tokenizer, prompt_token_ids: Sequence[int],
                     params: SamplingParams) -> IncrementalDetokenizer:
    if tokenizer is None:
        return IncrementalDetokenizer()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if _decode_stream_usable(backend):
        return FastIncrementalDetokenizer(backend, prompt_token_ids, params)
    return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)


_full_decode_stream: bool | None = None


def _decode_stream_usable(backend) -> bool:
    """A Rust tokenizer whose DecodeStream takes a prefill (`ids=`) and list steps (older
    tokenizers releases have neither: they get the slow path)."""
    global _full_decode_stream
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - transformers depends on tokenizers
        return False
    if not isinstance(backend, Tokenizer):
        return False
    if _full_decode_stream is None:
        try:
            DecodeStream(ids=[], skip_special_tokens=False).step(backend, [])
            _full_decode_stream = True
        except TypeError:
            _full_decode_stream = False
    return _full_decode_stream


def _prompt_context(decode, prompt_token_ids: Sequence[int]) -> list[int]:
    """The shortest prompt suffix (>= 4 tokens) that decodes without U+FFFD, else none."""
    n = len(prompt_token_ids)
    if n <= _MIN_PROMPT_CONTEXT:
        candidates = [n]
    else:
        candidates = range(_MIN_PROMPT_CONTEXT, min(n, _MAX_PROMPT_CONTEXT) + 1)
    for length in candidates:
        suffix = list(prompt_token_ids[n - length:])
        if REPLACEMENT_CHAR not in decode(suffix):
            return suffix
    return []


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    def __init__(self, backend, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self._DecodeStream = DecodeStream
        self.backend = backend
        self.skip_special_tokens = params.skip_special_tokens
        context = _prompt_context(self._decode, prompt_token_ids)
        self.stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        self._emitted_tail: list[int] = context[-_FLUSH_CONTEXT:]  # ids before `_held`
        self._held: list[int] = []  # ids fed since the stream last returned text

        # spaces_between_special_tokens=False (vLLM's rule for Rust decoders, which have no
        # such option): an added token right after another is emitted as its raw content,
        # without any space the decoder would have put in front of it.
        self.added_tokens: dict[int, str] | None = None
        if not (params.skip_special_tokens or params.spaces_between_special_tokens):
            added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
            self.added_tokens = added or None
        self._last_added = False

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        if self.added_tokens is None:
            return self._step(list(token_ids))
        pieces = []
        for token_id in token_ids:
            text = self._step([token_id])
            content = self.added_tokens.get(token_id)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
            pieces.append(text)
        return "".join(pieces)

    def _step(self, ids: list[int]) -> str:
        try:
            text = self.stream.step(self.backend, ids)
        except Exception as error:  # noqa: BLE001 - the stream's errors have no type of their own
            # tokenizers raises when a decoder's output is not monotonic (vLLM issue 17448):
            # decode the held ids plus these on their own and restart the stream after them.
            logger.warning("incremental detokenizer restarted after: %s", error)
            text = self._decode_with_context(self._held + ids)
            self.stream = self._DecodeStream(skip_special_tokens=self.skip_special_tokens)
        if text is None:
            self._held.extend(ids)
            return ""
        self._emitted_tail = (self._emitted_tail + self._held + ids)[-_FLUSH_CONTEXT:]
        self._held = []
        return text

    def _decode_with_context(self, ids: list[int]) -> str:
        context = self._emitted_tail
        prefix = self._decode(context)
        full = self._decode(context + ids)
        return full[len(prefix):] if full.startswith(prefix) else self._decode(ids)

    def flush(self) -> str:
        if not self._held:
            return ""
        text = self._decode_with_context(self._held)
        self._emitted_tail = (self._emitted_tail + self._held)[-_FLUSH_CONTEXT:]
        self._held = []
        return text


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """`ids[prefix:read]` is text already emitted (context); `ids[read:]` is held back."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.ids = _prompt_context(self._decode, prompt_token_ids)
        self.read_offset = len(self.ids)  # the window starts at 0: older ids are dropped
        self.prefix_text = self._decode(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        kwargs = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            kwargs["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(ids, **kwargs)

    def decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        text = self._decode(self.ids)
        if len(text) <= len(self.prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""  # a character is still incomplete: hold the ids back
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if text.startswith(self.prefix_text):
            delta = text[len(self.prefix_text):]
        else:  # a decoder that rewrote the context: decode the new ids on their own
            delta = self._decode(self.ids[self.read_offset:])
        # The emitted ids become the next step's context; the older context is dropped.
        self.ids = self.ids[self.read_offset:]
        self.read_offset = len(self.ids)
        self.prefix_text = self._decode(self.ids)
        return delta

    def flush(self) -> str:
        if self.read_offset == len(self.ids):
            return ""
        return self._advance(self._decode(self.ids))
