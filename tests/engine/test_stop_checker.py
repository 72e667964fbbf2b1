"""Stop strings, stop-token text, min_tokens and streaming hold-back on one completion."""

from __future__ import annotations

import random

import pytest

from mrv2.engine.detokenizer import make_detokenizer
from mrv2.engine.stop_checker import CompletionText, find_stop_string, stop_prefix_length
from mrv2.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def completion(tokenizer, streaming=True, **params) -> CompletionText:
    sp = SamplingParams(**params)
    return CompletionText(make_detokenizer(tokenizer, [0], sp), sp, streaming)


def stream(text: CompletionText, ids, delta: bool, stop_terminated=False):
    """Feed ids one per step; returns (handed-out texts, stop string, steps taken)."""
    shown = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        stop = text.update([token], stop_terminated=stop_terminated and last, finished=last)
        finished = last or stop is not None
        shown.append(text.next_text(finished, delta))
        if stop is not None:
            return shown, stop, i + 1
    return shown, None, len(ids)


def test_find_stop_string():
    assert find_stop_string("abcdef", 2, ["cd", "ef"], False) == ("ef", 4)
    # Only matches ending in the new characters count (older text was searched before).
    assert find_stop_string("abcdef", 1, ["cd"], False) is None
    assert find_stop_string("abcdef", 3, ["cd"], False) == ("cd", 2)
    assert find_stop_string("abcdef", 3, ["cd"], True) == ("cd", 4)
    # The earliest occurrence wins, whatever the list order; ties go to the list order.
    assert find_stop_string("xxabcd", 4, ["cd", "ab"], False) == ("ab", 2)
    assert find_stop_string("xxabcd", 4, ["abc", "ab"], True) == ("abc", 5)
    assert find_stop_string("abc", 0, ["a"], False) is None
    assert find_stop_string("abc", 3, [], False) is None


def test_stop_prefix_length():
    assert stop_prefix_length("hello wo", ["world"]) == 2
    assert stop_prefix_length("hello w", ["world", "lo w!"]) == 4
    assert stop_prefix_length("hello", ["world"]) == 0
    assert stop_prefix_length("hello world", ["world"]) == 0  # whole matches are not held
    assert stop_prefix_length("ab", ["abcdef"]) == 2


def test_stop_string_split_across_tokens(tokenizer):
    ids = tokenizer.encode("def main(): return value", add_special_tokens=False)
    stop = "(): ret"
    text = tokenizer.decode(ids)
    # The stop string spans several tokens and starts inside one.
    assert not any(tokenizer.decode([t]) == stop for t in ids)
    for include in (False, True):
        ct = completion(tokenizer, stop=[stop], include_stop_str_in_output=include)
        shown, found, steps = stream(ct, ids, delta=False)
        assert found == stop and steps < len(ids)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert ct.text == shown[-1] == text[:cut]


def test_stop_string_inside_one_multibyte_character(tokenizer):
    ids = tokenizer.encode("ab你好🙂c", add_special_tokens=False)
    good = tokenizer.encode("好", add_special_tokens=False)
    assert len(good) == 3 and all(tokenizer.decode([t]) == "\ufffd" for t in good)
    for include, want in ((False, "ab你"), (True, "ab你好")):
        ct = completion(tokenizer, stop=["好"], include_stop_str_in_output=include)
        shown, found, steps = stream(ct, ids, delta=True)
        assert found == "好"
        # It stops on the token that completes the character, not one earlier or later.
        assert tokenizer.decode(ids[:steps]) == "ab你好"
        assert "".join(shown) == ct.text == want
        assert all("\ufffd" not in s for s in shown)


@pytest.mark.parametrize("delta", [True, False])
def test_hold_back_never_shows_a_stop_prefix_or_later_text(tokenizer, delta):
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "stop", "sto", "st", "s", "pots", "你好", " ", "\n"]
    num_stopped = 0
    for _ in range(60):
        body = "".join(rng.choice(words) for _ in range(rng.randrange(3, 25)))
        stops = rng.choice([["stop"], ["stop", "a b"], ["mma", "你好"], ["zzz"]])
        ids = tokenizer.encode(body, add_special_tokens=False)
        ct = completion(tokenizer, stop=stops)
        shown, found, _ = stream(ct, ids, delta)
        final = ct.text
        # Everything handed out is a prefix of the final text; no stop string shows.
        cumulative = "".join(shown) if delta else shown[-1]
        assert cumulative == final
        partials = ([("".join(shown[:i + 1])) for i in range(len(shown))] if delta else shown)
        for p in partials:
            assert final.startswith(p)
            assert not any(s in p for s in stops)
        occurrences = [body.find(s) for s in stops if s in body]
        if occurrences:  # (no stop list here has one stop string inside another)
            assert found is not None and final == body[:min(occurrences)]
            num_stopped += 1
        else:
            assert found is None and final == body
    assert 15 < num_stopped < 55


def test_hold_back_holds_only_possible_prefixes(tokenizer):
    ct = completion(tokenizer, stop=["world"])
    ids = tokenizer.encode("hello wor", add_special_tokens=False)
    ct.update(ids, stop_terminated=False, finished=False)
    assert ct.next_text(False, delta=True) == "hello "  # "wor" could still become "world"
    ct.update(tokenizer.encode("k", add_special_tokens=False), False, False)
    assert ct.next_text(False, delta=True) == "work"
    # At the end everything is handed out, even a stop prefix.
    ct.update(tokenizer.encode(" wo", add_special_tokens=False), False, True)
    assert ct.next_text(True, delta=True) == " wo"


def test_stop_token_text_excluded_unless_included(tokenizer):
    ids = tokenizer.encode("hi", add_special_tokens=False) + [4]  # <|im_end|> stop token
    for include, want in ((False, "hi"), (True, "hi<|im_end|>")):
        ct = completion(tokenizer, streaming=False, skip_special_tokens=False,
                        include_stop_str_in_output=include)
        assert ct.update(ids, stop_terminated=True, finished=True) is None
        assert ct.text == want and ct.num_tokens == len(ids)
    # Not stop-terminated (a length finish): the last token's text stays.
    ct = completion(tokenizer, streaming=False, skip_special_tokens=False)
    ct.update(ids, stop_terminated=False, finished=True)
    assert ct.text == "hi<|im_end|>"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = tokenizer.encode("ab ab ab ab", add_special_tokens=False)
    assert len(ids) >= 4
    ct = completion(tokenizer, stop=["ab"], min_tokens=len(ids) - 1)
    found = [ct.update([t], False, False) for t in ids]
    # Only the last token's text may end a stop string.
    assert found[:-1] == [None] * (len(ids) - 1) and found[-1] == "ab"
    assert ct.text == "ab ab ab "


def test_final_only_without_stop_decodes_once_at_the_end(tokenizer):
    ids = tokenizer.encode("你好 there", add_special_tokens=False)
    ct = completion(tokenizer, streaming=False)
    assert ct.lazy
    for t in ids[:-1]:
        assert ct.update([t], False, False) is None
        assert ct.text == ""
    ct.update(ids[-1:], False, True)
    assert ct.text == ct.next_text(True, delta=False) == "你好 there"
