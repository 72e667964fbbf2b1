"""Incremental detokenizers: deltas concatenate to tokenizer.decode, whole characters only."""

from __future__ import annotations

import random

import pytest

from mrv2.engine.detokenizer import (FastIncrementalDetokenizer, IncrementalDetokenizer,
                                     SlowIncrementalDetokenizer, make_detokenizer)
from mrv2.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
TEXT = "你好🙂 héllo wörld ∑x² — naïve café 日本語"
IMPLS = ["fast", "slow"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


class RecordingTokenizer:
    """A tokenizer without a Rust backend (forces the slow path) that records decode sizes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.decoded_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def make(impl: str, tokenizer, prompt_ids, **params) -> IncrementalDetokenizer:
    sp = SamplingParams(**params)
    if impl == "fast":
        det = make_detokenizer(tokenizer, prompt_ids, sp)
        assert isinstance(det, FastIncrementalDetokenizer)
        return det
    return SlowIncrementalDetokenizer(tokenizer, prompt_ids, sp)


def feed(det: IncrementalDetokenizer, ids, chunk_sizes=None) -> list[str]:
    deltas, i = [], 0
    while i < len(ids):
        n = 1 if chunk_sizes is None else chunk_sizes(i)
        deltas.append(det.decode(ids[i:i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


def test_factory_picks_the_implementation(tokenizer):
    params = SamplingParams()
    assert isinstance(make_detokenizer(tokenizer, [0, 5], params), FastIncrementalDetokenizer)
    slow = make_detokenizer(RecordingTokenizer(tokenizer), [0, 5], params)
    assert isinstance(slow, SlowIncrementalDetokenizer)
    none = make_detokenizer(None, [0, 5], params)
    assert type(none) is IncrementalDetokenizer
    assert none.decode([5, 6]) == "" and none.flush() == ""


@pytest.mark.parametrize("impl", IMPLS)
def test_multibyte_characters_split_across_tokens(impl, tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The test means something only if some characters really are split into byte tokens.
    assert sum(tokenizer.decode([t]) == REPLACEMENT for t in ids) >= 6
    det = make(impl, tokenizer, tokenizer("a prompt").input_ids)
    deltas = feed(det, ids)
    assert "".join(deltas) == TEXT
    # Never a half character: no U+FFFD, and every cumulative text is a prefix of the final.
    assert all(REPLACEMENT not in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left held back
    # The first character comes out whole, with its last byte token.
    first = tokenizer.encode(TEXT[0], add_special_tokens=False)
    assert deltas[:len(first)] == [""] * (len(first) - 1) + [TEXT[0]]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_concatenate_to_decode(impl, tokenizer, skip_special_tokens):
    rng = random.Random(42 + skip_special_tokens)
    vocab = tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 2048
    for trial in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        det = make(impl, tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        chunks = (lambda i: 1) if trial % 2 else (lambda i: rng.randrange(1, 5))
        got = "".join(feed(det, ids, chunks))
        want = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert got == want, (prompt, ids)


@pytest.mark.parametrize("impl", IMPLS)
def test_cut_character_is_flushed_as_replacement(impl, tokenizer):
    # A length limit that cuts a character: the held bytes decode as tokenizer.decode does.
    ids = tokenizer.encode("ab你", add_special_tokens=False)[:-1]
    det = make(impl, tokenizer, [0])
    streamed = "".join(det.decode([t]) for t in ids)
    assert streamed == "ab"
    assert streamed + det.flush() == tokenizer.decode(ids)
    assert det.flush() == ""  # flushing twice gives nothing more


@pytest.mark.parametrize("impl", IMPLS)
def test_prompt_context_is_not_emitted(impl, tokenizer):
    prompt = tokenizer("The prompt text, with 你好 in it").input_ids
    ids = tokenizer.encode(" and the output", add_special_tokens=False)
    assert "".join(feed(make(impl, tokenizer, prompt), ids)) == " and the output"
    # A prompt that ends in the middle of a character is not used as context.
    cut = tokenizer.encode("xy你", add_special_tokens=False)
    det = make(impl, tokenizer, cut[:-1])
    assert "".join(feed(det, cut[-1:] + ids)) == tokenizer.decode(cut[-1:] + ids)


@pytest.mark.parametrize("impl", IMPLS)
def test_special_tokens(impl, tokenizer):
    body = tokenizer.encode("hi", add_special_tokens=False)
    ids = [3] + body + [4, 3, 1]  # <|im_start|> hi <|im_end|> <|im_start|> <|end_of_text|>
    shown = "".join(feed(make(impl, tokenizer, [0], skip_special_tokens=False), ids))
    assert shown == "<|im_start|>hi<|im_end|><|im_start|><|end_of_text|>"
    assert "".join(feed(make(impl, tokenizer, [0]), ids)) == "hi"
    no_spaces = make(impl, tokenizer, [0], skip_special_tokens=False,
                     spaces_between_special_tokens=False)
    assert "".join(feed(no_spaces, ids)) == tokenizer.decode(ids, skip_special_tokens=False)


def test_slow_window_stays_small(tokenizer):
    # O(1) per token: each decode sees only a short window, never the whole output.
    recording = RecordingTokenizer(tokenizer)
    ids = tokenizer.encode(TEXT * 30, add_special_tokens=False)
    det = make_detokenizer(recording, [0, 5, 6, 7, 8, 9], SamplingParams())
    assert "".join(feed(det, ids)) == TEXT * 30
    assert len(ids) > 500 and max(recording.decoded_lengths) <= 10


def test_fast_keeps_no_history(tokenizer):
    ids = tokenizer.encode(TEXT * 30, add_special_tokens=False)
    det = make("fast", tokenizer, [0])
    for t in ids:
        det.decode([t])
        assert len(det._held) <= 4 and len(det._emitted_tail) <= 4
