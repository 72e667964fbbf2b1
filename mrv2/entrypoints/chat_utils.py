"""Chat template rendering, shared by `LLM.chat` and the OpenAI server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def render_chat(tokenizer, conversation: Sequence[Mapping[str, Any]],
                chat_template: str | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False,
                template_kwargs: Mapping[str, Any] | None = None,
                add_special_tokens: bool | None = None) -> dict[str, Any]:
    """The conversation rendered with the tokenizer's chat template (or `chat_template`):
    {"prompt": text, "prompt_token_ids": ids}. `add_special_tokens` None: only when the
    rendered text does not start with the BOS. Raises ValueError on unusable input."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer with a chat template, and this model has no "
                         "tokenizer")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass a chat template, or use "
                         "completions with a formatted prompt")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    text = tokenizer.apply_chat_template(
        [dict(m) for m in conversation], tokenize=False, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, **dict(template_kwargs or {}))
    # Templates that write the BOS themselves must not get a second one from the encoder;
    # templates that leave it out (ChatML) rely on the encoder adding it.
    if add_special_tokens is None:
        bos = getattr(tokenizer, "bos_token", None)
        add_special_tokens = not (bos and text.startswith(bos))
    token_ids = list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return {"prompt_token_ids": token_ids, "prompt": text}


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the template itself (vLLM's rule: a value with no
    Jinja or newline characters is a path, and must exist)."""
    if value is None:
        return None
    try:
        path = Path(value)
        if path.is_file():
            return path.read_text()
    except OSError:  # a long inline template is not a valid path
        pass
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"chat template {value!r} looks like a file path, but no such file exists")
