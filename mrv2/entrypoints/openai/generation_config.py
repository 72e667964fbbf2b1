"""`--generation-config`: default sampling parameters from the model's generation_config.json.

`auto` (vLLM's default) applies the sampling fields the model's generation_config.json sets
(temperature, top_p, top_k, min_p, repetition_penalty) as defaults that a request's own values
override; its max_new_tokens caps max_tokens, requested or not (vLLM's rule). `vllm` applies
none: OpenAI's defaults. Any other value is a folder whose generation_config.json is read the
way `auto` reads the model's (vLLM's third form); that folder and file must exist, since the
user named them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")  # or a folder path


def check_mode(mode: str) -> None:
    """ValueError unless `mode` is "auto", "vllm" or a folder holding generation_config.json."""
    if mode not in MODES and not (Path(mode) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config must be 'auto', 'vllm' or a folder holding a "
                         f"generation_config.json; {mode!r} is not")


def default_sampling_params(model_dir: str, mode: str = "auto") -> dict[str, Any]:
    """The defaults to apply, by SamplingParams field name (empty for mode "vllm"). `mode` is
    "auto", "vllm" or a folder holding a generation_config.json."""
    check_mode(mode)
    if mode == "vllm":
        return {}
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        if mode != "auto":
            raise ValueError(f"--generation-config {mode!r}: unreadable {path}: {error}") from None
        logger.warning("ignoring unreadable %s: %s", path, error)
        return {}
    if not isinstance(config, dict):
        return {}
    defaults = {ours: config[theirs] for theirs, ours in _FIELDS.items()
                if isinstance(config.get(theirs), (int, float))
                and not isinstance(config.get(theirs), bool)}
    if defaults:
        logger.info("default sampling parameters from %s: %s", path, defaults)
    return defaults
