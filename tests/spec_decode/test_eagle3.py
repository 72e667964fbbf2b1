"""EAGLE-3 speculation (method "eagle3": models/eagle3.py's head fed the target's layer
streams, spec_decode/eagle.py's proposer) end to end: the target's tokens with and without
it; a head that drafts a repeater target's tokens (mrv2/testing/tiny_eagle.py) has its drafts
kept, which only a head fed the right streams, through its draft vocabulary, can."""

from __future__ import annotations

import json

import pytest

from mrv2 import LLM
from mrv2.config import ConfigError
from mrv2.models.registry import UnsupportedModelError
from mrv2.testing.tiny_eagle import make_eagle3_head, make_eagle_head, repeater_target
from tests.spec_decode.test_draft_model import ENGINE, counters, greedy, tokens
from tests.spec_decode.test_eagle import assert_targets_tokens


def eagle3(target, head, k: int = 3, **kwargs) -> LLM:
    return LLM(str(target), speculative_config={"method": "eagle3", "model": str(head),
                                                "num_speculative_tokens": k},
               **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    return tiny_model_factory("llama", num_layers=4)


def test_a_random_head_gives_the_targets_tokens(target, tmp_path):
    """Greedy, penalties and seeded sampling, a head of two layers and a draft vocabulary of
    a quarter of the target's: the same tokens as without speculation."""
    head = make_eagle3_head(tmp_path / "head", target, seed=3, num_layers=2,
                            draft_vocab_size=512, aux_layers=[0, 2, 3])
    assert_targets_tokens(LLM(str(target), **ENGINE), eagle3(target, head, k=2))


def test_a_head_fed_the_right_streams_has_its_drafts_kept(target, tmp_path, rows_cost_little):
    """The repeater target repeats each prompt's last token; its head drafts the token of the
    last of its three streams, through a draft vocabulary holding every 4th token (the
    prompts end on such tokens)."""
    repeater = repeater_target(tmp_path / "target", target)
    head = make_eagle3_head(tmp_path / "head", repeater, draft_vocab_size=512, repeater=True,
                            aux_layers=[1, 2, 3])
    prompts = [{"prompt_token_ids": [7, 19, 4 * t + 400]} for t in range(3)]
    want = tokens(LLM(str(repeater), **ENGINE), greedy(30), prompts)
    assert all(len(set(row)) == 1 for row in want)  # it repeats
    llm = eagle3(repeater, head)
    # One at a time: a step's verify rows stay within the fused stack's call (its LM head's
    # rows), which three requests' drafts would pass.
    assert [tokens(llm, greedy(30), [p])[0] for p in prompts] == want
    drafted, accepted = counters(llm)
    assert drafted > 40 and accepted >= 0.9 * drafted


def test_heads_that_do_not_fit_are_refused(target, tiny_model_factory, tmp_path):
    with pytest.raises(ConfigError, match="3 distinct layers"):  # (2, 2, 1) of 4 layers
        eagle3(target, make_eagle3_head(tmp_path / "default", target))
    with pytest.raises(ConfigError, match="3 distinct layers"):
        eagle3(target, make_eagle3_head(tmp_path / "far", target, aux_layers=[0, 1, 9]))
    head = make_eagle3_head(tmp_path / "head", target, aux_layers=[0, 1, 3])
    with pytest.raises(ConfigError, match="LlamaForCausalLMEagle3"):  # an EAGLE-1 head
        eagle3(target, make_eagle_head(tmp_path / "eagle1", target))
    with pytest.raises(ConfigError, match=r"\['LlamaForCausalLM'\]"):
        LLM(str(target), speculative_config={"method": "eagle", "model": str(head),
                                             "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(UnsupportedModelError, match="EAGLE-3 draft head"):
        LLM(str(head), **ENGINE)
    config = json.loads((head / "config.json").read_text())
    config["eagle_config"]["use_aux_hidden_state"] = False
    (head / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="use_aux_hidden_state"):
        eagle3(target, head)
    gemma = tiny_model_factory("gemma2", num_layers=4)
    with pytest.raises((ConfigError, ValueError), match="sliding-window|layers' input streams"):
        eagle3(gemma, make_eagle3_head(tmp_path / "gemma", gemma, aux_layers=[0, 1, 3]))
