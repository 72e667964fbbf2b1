"""The vocabulary part of gguf_writer.py (llama.cpp's converter port): ``_set_vocab_gpt2`` with
``get_vocab_base``'s token list and types, and the BPE pre-tokenizer name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf

# Split regexes of known BPE pre-tokenizers -> llama.cpp's `pre` name for them.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


def bpe_pre_name(tokenizer_json: dict[str, Any]) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE tokenizer.json: which regex splits
    text before the merges (the converter identifies it by hashing a probe tokenization, which only
    works for tokenizers in its table)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "gpt-2"  # ByteLevel's built-in regex is GPT-2's
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)):
        name = _SPLIT_PRE.get(steps[0].get("pattern", {}).get("Regex"))
        if name is not None:
            return name
    raise NotImplementedError(f"BPE pre-tokenizer not recognized: {json.dumps(pre)[:200]}")


def add_vocab(writer: gguf.GGUFWriter, model_dir: Path, hparams: dict[str, Any]) -> None:
    """``_set_vocab_gpt2`` with ``get_vocab_base``'s token list and types."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = hparams.get("vocab_size", len(tokenizer.vocab))
    if max(tokenizer.vocab.values()) >= vocab_size:
        raise ValueError(f"tokenizer ids reach past vocab_size {vocab_size}")
    pre = bpe_pre_name(json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8")))
    reverse_vocab = {id_: tok for tok, id_ in tokenizer.vocab.items()}
    added_vocab = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    toktypes: list[int] = []
    for i in range(vocab_size):
        if i not in reverse_vocab:
            tokens.append(f"[PAD{i}]")
            toktypes.append(gguf.TokenType.UNUSED)
            continue
        token = reverse_vocab[i]
        if token in added_vocab:
            # llama.cpp assumes CONTROL and USER_DEFINED tokens are pre-normalized.
            if not added_decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if added_decoder[i].special or _looks_special(token):
                toktypes.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                toktypes.append(gguf.TokenType.USER_DEFINED)
        else:
            toktypes.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(toktypes)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def _looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))
