"""Chat template rendering (shared by LLM.chat and the server) and --chat-template loading."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from mrv2.entrypoints.chat_utils import load_chat_template, render_chat

CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_render_adds_the_bos_only_when_the_template_does_not(tokenizer):
    out = render_chat(tokenizer, CONVERSATION)
    assert out["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_token_ids"] == tokenizer(out["prompt"]).input_ids
    with_bos = render_chat(tokenizer, CONVERSATION,
                           chat_template="{{ bos_token }}{{ messages[0]['content'] }}")
    assert with_bos["prompt_token_ids"].count(tokenizer.bos_token_id) == 1
    forced = render_chat(tokenizer, CONVERSATION, add_special_tokens=False)
    assert forced["prompt_token_ids"] == out["prompt_token_ids"][1:]
    no_prompt = render_chat(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert no_prompt["prompt"] == "<|im_start|>user\nhi<|im_end|>\n"


def test_render_errors(tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="no tokenizer"):
        render_chat(None, CONVERSATION)
    with pytest.raises(ValueError, match="cannot both"):
        render_chat(tokenizer, CONVERSATION, continue_final_message=True)
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tokenizer, CONVERSATION)


def test_load_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ x }}")
    assert load_chat_template(str(path)) == "{{ x }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template("x" * 5000 + "{{ y }}").endswith("{{ y }}")
