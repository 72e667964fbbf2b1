"""A model's generation_config.json: which token ids end a request, and the default sampling
parameters it suggests.

Everything that reads the file goes through `read_generation_config`: the front end's EOS ids
(input_processor.py), the runner's min_tokens mask (runner.py -> sampler/states.py), the
offline `LLM`'s defaults and the server's `--generation-config` (both through
entrypoints/openai/generation_config.py). A model given as a single file (`.gguf`) has no
generation_config.json: its EOS ids come from `hf_config` alone (the GGUF loader fills it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json name -> SamplingParams name: vLLM's get_diff_sampling_param fields.
SAMPLING_FIELDS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class GenerationConfigError(ValueError):
    """A generation_config.json that had to be read (strict) is missing or unreadable."""


def read_generation_config(folder: str | os.PathLike[str] | None, *,
                           strict: bool = False) -> dict[str, Any]:
    """The JSON object in `folder`/generation_config.json; {} when `folder` is not a directory
    (a single-file model), has no such file, or (not `strict`: logged) holds something
    unreadable or not an object. `strict` raises GenerationConfigError instead."""
    if folder is None:
        return {}
    path = Path(folder) / GENERATION_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        if strict:
            raise GenerationConfigError(f"unreadable {path}: {error}") from None
        if not isinstance(error, (FileNotFoundError, NotADirectoryError)):
            logger.warning("ignoring unreadable %s: %s", path, error)
        return {}
    if not isinstance(config, dict):
        if strict:
            raise GenerationConfigError(f"{path} does not hold a JSON object")
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    return config


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The SamplingParams defaults a generation config sets, by SamplingParams field name
    (`max_new_tokens` becomes `max_tokens`); non-numeric values are skipped."""
    return {ours: value for theirs, ours in SAMPLING_FIELDS.items()
            if isinstance(value := generation_config.get(theirs), (int, float))
            and not isinstance(value, bool)}


def eos_token_ids(hf_config: Any, model: str | os.PathLike[str] | None,
                  tokenizer_eos_token_id: int | None = None) -> tuple[int, ...]:
    """Every token id that ends a request of this model (unless ignore_eos), without repeats:
    the tokenizer's EOS when given (vLLM's primary EOS), then `hf_config.eos_token_id`, then
    `eos_token_id` of `model`'s generation_config.json (each an int or a list). The first id
    is the primary one; empty when nothing names one.

    The worker calls this without a tokenizer; the front end passes its tokenizer's EOS, so its
    tuple may have that one id more (the scheduler sends it to the runner per request)."""
    ids: dict[int, None] = {}  # ordered set
    _add_ids(ids, tokenizer_eos_token_id)
    _add_ids(ids, getattr(hf_config, "eos_token_id", None))
    _add_ids(ids, read_generation_config(model).get("eos_token_id"))
    return tuple(ids)


def _add_ids(ids: dict[int, None], value: Any) -> None:
    values: Iterable[Any] = value if isinstance(value, (list, tuple)) else (value,)
    for token in values:
        if isinstance(token, int) and not isinstance(token, bool) and token >= 0:
            ids[token] = None
