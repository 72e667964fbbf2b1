"""The tokenizer a GGUF file describes in its metadata (vocabulary, merges, special ids, chat
template), built by transformers' GGUF tokenizer converter from the already-opened checkpoint,
so the file is parsed once for config, tokenizer and weights."""

from __future__ import annotations

from typing import Any

from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError

_TOKENS_KEY = "tokenizer.ggml.tokens"
_SPECIAL_TOKEN_KEYS = {"bos_token": "tokenizer.ggml.bos_token_id",
                       "eos_token": "tokenizer.ggml.eos_token_id",
                       "unk_token": "tokenizer.ggml.unknown_token_id",
                       "pad_token": "tokenizer.ggml.padding_token_id"}


def has_tokenizer(ckpt: GGUFCheckpoint) -> bool:
    return bool(ckpt.fields.get(_TOKENS_KEY))


def gguf_tokenizer(ckpt: GGUFCheckpoint) -> Any:
    """A transformers fast tokenizer equal to `AutoTokenizer.from_pretrained(dir,
    gguf_file=...)` on the same file."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if not has_tokenizer(ckpt):
        raise GGUFError(f"{ckpt.path}: the file holds no tokenizer ({_TOKENS_KEY} is missing); "
                        f"pass a tokenizer directory or Hub id with --tokenizer")
    fields = ckpt.fields
    groups = {group: {name: fields[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in fields}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, init_kwargs = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        init_kwargs.setdefault("add_bos_token", True)
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        # Gemma 4's chat template writes <bos> itself: its own tokenizer adds none, whatever
        # the file's flag says (transformers reads the file so; llama.cpp forces BOS on).
        init_kwargs["add_bos_token"] = False
    tokens = tokenizer_dict["tokens"]
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = fields.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            init_kwargs[name] = tokens[token_id]
    try:
        backend, extra = convert_gguf_tokenizer(ckpt.architecture, tokenizer_dict)
    except Exception as error:  # noqa: BLE001 - any converter failure: name the file
        raise GGUFError(f"{ckpt.path}: cannot build its tokenizer "
                        f"({type(error).__name__}: {error}); pass --tokenizer") from None
    init_kwargs.update(extra)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **init_kwargs)
    tokenizer.name_or_path = str(ckpt.path)
    return tokenizer
