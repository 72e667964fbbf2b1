"""Reasoning parsers: whole-output (reasoning, content) as vLLM's current deepseek_r1 / qwen3
parsers give them, streaming that reassembles to it for every chunking, and the token-level
end check."""

from __future__ import annotations

import pytest

from mrv2.entrypoints.openai.reasoning_parsers import (REASONING_PARSERS, ReasoningParser,
                                                       get_reasoning_parser)

from .stream_helpers import chunkings as stream_chunkings


def chunkings(text: str, seeds: int = 10):
    """Whole, one character at a time, random sizes up to 6 (fixed seeds), every cut in two."""
    return stream_chunkings(text, seeds, max_piece=6)


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content, previous = [], [], ""
    for piece in pieces:
        r, c = parser.extract_reasoning_streaming(previous, previous + piece, piece)
        previous += piece
        assert r != "" and c != "", "an empty piece is None"
        reasoning.append(r or "")
        content.append(c or "")
    r, c = parser.finish_reasoning_streaming()
    reasoning.append(r or "")
    content.append(c or "")
    return "".join(reasoning), "".join(content)


def check(name: str, text: str, reasoning: str | None, content: str | None, **kwargs) -> None:
    cls = get_reasoning_parser(name)
    assert cls(None, **kwargs).extract_reasoning(text) == (reasoning, content)
    for pieces in chunkings(text):
        assert stream(cls(None, **kwargs), pieces) == (reasoning or "", content or ""), pieces


CASES = [
    # the template put <think> in the prompt: only </think> in the output
    ("Let me think.\nOK.\n</think>\n\nThe answer is 4.", "Let me think.\nOK.\n",
     "\n\nThe answer is 4."),
    # the model wrote <think> itself: removed, the newlines around it kept
    ("<think>\nHmm, 2+2.\n</think>\n\n4", "\nHmm, 2+2.\n", "\n\n4"),
    ("<think>plan</think>", "plan", None),  # nothing after </think>: content None
    ("</think>straight to it", "", "straight to it"),
    # no </think>: cut short while thinking, all reasoning
    ("Still thinking about <thin", "Still thinking about <thin", None),
    ("<think>still going", "still going", None),
    ("", "", None),
    # markers that are not markers: < and </ and <think in the text, a second <think>
    ("a < b and c </ d <think <thinking> x</think> y <think> z </think> w",
     "a < b and c </ d <think <thinking> x", " y <think> z </think> w"),
    ("x<think>y<think>z</think>", "xy<think>z", None),
    ("é 😀 <</think><<think>", "é 😀 <", "<<think>"),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_reasoning_split(name, text, reasoning, content):
    check(name, text, reasoning, content)


@pytest.mark.parametrize("text", ["Plain answer.", "odd </think> in it"])
def test_qwen3_thinking_disabled_is_all_content(text):
    check("qwen3", text, None, text, chat_template_kwargs={"enable_thinking": False})


def test_deepseek_ignores_enable_thinking():
    check("deepseek_r1", "a</think>b", "a", "b", chat_template_kwargs={"enable_thinking": False})


class VocabTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_is_reasoning_end(name):
    parser = get_reasoning_parser(name)(VocabTokenizer({"<think>": 7, "</think>": 8, "a": 1}))
    assert (parser.start_token_id, parser.end_token_id) == (7, 8)
    assert not parser.is_reasoning_end([])
    assert not parser.is_reasoning_end([1, 7, 1])
    assert parser.is_reasoning_end([1, 7, 1, 8, 1])
    assert parser.is_reasoning_end([8])  # <think> was in the prompt's text, not these ids
    assert not parser.is_reasoning_end([7, 8, 1, 7])  # thinking again after a closed block
    assert parser.is_reasoning_end([7, 8, 1, 7, 1, 8])


def test_without_marker_tokens():
    for tokenizer in (None, VocabTokenizer({"a": 1})):
        parser = get_reasoning_parser("qwen3")(tokenizer)
        assert parser.end_token_id is None and parser.start_token_id is None
        assert not parser.is_reasoning_end([1, 2, 3])
        assert parser.extract_reasoning("x</think>y") == ("x", "y")


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


def test_engine_config_knows_every_parser():
    """The engine validates --reasoning-parser against its own list (config.py cannot import
    the server's parsers): the two lists agree."""
    from mrv2.config import REASONING_PARSER_NAMES
    from mrv2.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    assert set(REASONING_PARSERS) == set(REASONING_PARSER_NAMES)
