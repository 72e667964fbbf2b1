"""`--generation-config` (server) / `LLM(generation_config=...)`: which generation_config.json
gives the default sampling parameters.

`auto` (vLLM's default) applies the sampling fields the model's generation_config.json sets
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens). The
server uses them as defaults that a request's own values override, and its max_new_tokens caps
max_tokens, requested or not (vLLM's rule); `LLM.generate` uses them when it is given no
sampling params. `vllm` applies none: OpenAI's defaults. Any other value is a folder whose
generation_config.json is read the way `auto` reads the model's (vLLM's third form); that
folder and file must exist, since the user named them. The file is read by
mrv2/models/generation_config.py, which also gives the model's EOS ids (those never depend on
this mode).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from mrv2.models.generation_config import (GENERATION_CONFIG_FILE, GenerationConfigError,
                                           read_generation_config, sampling_defaults)

logger = logging.getLogger(__name__)

MODES = ("auto", "vllm")  # or a folder path


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is "auto", "vllm" or a folder holding generation_config.json."""
    if mode not in MODES and not (Path(mode) / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder holding a "
                         f"{GENERATION_CONFIG_FILE}; {mode!r} is not")


def default_sampling_params(model_dir: str, mode: str = "auto") -> dict[str, Any]:
    """The defaults to apply, by SamplingParams field name (empty for mode "vllm"). `mode` is
    "auto", "vllm" or a folder holding a generation_config.json."""
    check_mode(mode)
    if mode == "vllm":
        return {}
    folder = model_dir if mode == "auto" else mode
    try:
        config = read_generation_config(folder, strict=mode != "auto")
    except GenerationConfigError as error:
        raise ValueError(f"--generation-config {mode!r}: {error}") from None
    defaults = sampling_defaults(config)
    if defaults:
        logger.info("default sampling parameters from %s: %s",
                    Path(folder) / GENERATION_CONFIG_FILE, defaults)
    return defaults
