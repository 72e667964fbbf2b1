"""Engine logprobs -> the legacy completions format and the chat format."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mrv2.entrypoints.openai.logprobs_format import MIN_LOGPROB, CompletionLogprobs, chat_logprobs


@dataclass
class Lp:  # the shape of mrv2.outputs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class FakeTokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


STEPS = [{5: Lp(-0.5, 1, "he"), 6: Lp(-1.5, 2, "ha")},
         {7: Lp(-2.0, 3, "llo"), 8: Lp(-0.1, 1, "y"), 9: Lp(-math.inf, 9, "z")}]


def test_legacy_format_with_offsets_across_chunks():
    builder = CompletionLogprobs(FakeTokenizer())
    first = builder.build([5], STEPS[:1])
    second = builder.build([7], STEPS[1:])
    assert first == {"tokens": ["he"], "token_logprobs": [-0.5],
                     "top_logprobs": [{"he": -0.5, "ha": -1.5}], "text_offset": [0]}
    assert second["tokens"] == ["llo"] and second["text_offset"] == [2]
    assert second["top_logprobs"] == [{"llo": -2.0, "y": -0.1, "z": MIN_LOGPROB}]


def test_legacy_prompt_part_starts_with_none_and_decodes_missing_tokens():
    builder = CompletionLogprobs(FakeTokenizer(), text_offset=0)
    out = builder.build([1, 5], [None, {5: Lp(-0.25), 3: Lp(-2.0)}])
    assert out["tokens"] == ["<1>", "<5>"]
    assert out["token_logprobs"] == [None, -0.25]
    assert out["top_logprobs"] == [None, {"<5>": -0.25, "<3>": -2.0}]
    assert out["text_offset"] == [0, 3]


def test_chat_format_orders_the_top_list_and_gives_bytes():
    out = chat_logprobs([5, 7], STEPS, FakeTokenizer(), num_top=2)["content"]
    assert [e["token"] for e in out] == ["he", "llo"]
    assert out[0]["bytes"] == list(b"he") and out[1]["logprob"] == -2.0
    assert [t["token"] for t in out[1]["top_logprobs"]] == ["y", "llo"]
    assert [t["token"] for t in out[0]["top_logprobs"]] == ["he", "ha"]
    assert chat_logprobs([5], STEPS[:1], None, num_top=0)["content"][0]["top_logprobs"] == []
    unicode = chat_logprobs([4], [{4: Lp(-1.0, 1, "é")}], None, 1)["content"][0]
    assert unicode["bytes"] == [0xC3, 0xA9]
