"""The tokenizer of a model: loaded by the front end (prompts, detokenizing) and, when a request
needs a grammar, by the engine core (grammar compilation reads the vocabulary)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    """The tokenizer of a model directory or GGUF file (`ModelConfig.tokenizer_path`), or None
    when a directory has none (token-id prompts only; a GGUF file without one was refused
    when the engine config was built)."""
    from transformers import AutoTokenizer

    from mrv2.models.gguf import gguf_tokenizer, is_gguf_path, open_gguf

    if is_gguf_path(path):
        return gguf_tokenizer(open_gguf(path))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work",
                       path, error)
        return None
