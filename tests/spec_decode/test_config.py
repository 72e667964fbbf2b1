"""SpeculativeConfig: vLLM's keys taken, defaults resolved, the rest refused by name."""

from __future__ import annotations

import pytest

from mrv2.config import ConfigError
from mrv2.spec_decode.config import DEFAULT_PROMPT_LOOKUP, SpeculativeConfig


def test_none_is_no_speculation():
    assert SpeculativeConfig.from_value(None) is None


@pytest.mark.parametrize("given, expected", [
    ({}, (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)),
    ({"prompt_lookup_max": 4}, (4, 4)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 3}, (1, 3)),
])
def test_ngram_lookup_bounds(given, expected):
    config = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3,
                                           **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == expected


def test_suffix_defaults_to_its_tree_depth():
    config = SpeculativeConfig.from_value({"method": "suffix",
                                           "suffix_decoding_max_tree_depth": 8})
    assert config.num_speculative_tokens == 8
    assert SpeculativeConfig.from_value({"method": "suffix"}).num_speculative_tokens == 24


def test_a_model_alone_is_a_draft_model():
    """vLLM's: `model` without a method drafts with that model; it needs more lookahead KV
    (its drafts' KV) than the methods without a model."""
    config = SpeculativeConfig.from_value({"model": "x", "num_speculative_tokens": 3})
    assert config.method == "draft_model" and config.num_lookahead_tokens == 3
    ngram = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 3})
    assert ngram.num_lookahead_tokens == 0
    eagle = SpeculativeConfig.from_value({"method": "eagle", "model": "x",
                                          "num_speculative_tokens": 2})
    assert eagle.num_lookahead_tokens == 2


@pytest.mark.parametrize("value, match", [
    ({"method": "mtp", "num_speculative_tokens": 3}, "mtp.*not implemented"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle', which needs it"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "'eagle3', which needs it"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "medusa.*not implemented"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs it"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 3}, "not 'ngram'"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "unsharded"),
    ({"model": "x", "num_speculative_tokens": 3, "max_model_len": 64},
     "max_model_len is not implemented"),
    ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}, "unknown key.*bogus"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "nope", "num_speculative_tokens": 3}, "expected one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "larger than"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2.0}, r"\[0, 1\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "positive integer"),
    ("ngram", "must be a dict"),
])
def test_refused_by_name(value, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.from_value(value)
