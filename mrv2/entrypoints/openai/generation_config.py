"""`--generation-config`: default sampling parameters from the model's generation_config.json.

`auto` (vLLM's default) applies the sampling fields the model's generation_config.json sets
(temperature, top_p, top_k, min_p, repetition_penalty) as defaults that a request's own values
override; its max_new_tokens caps max_tokens, requested or not (vLLM's rule). `vllm` applies
none: OpenAI's defaults.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")


def default_sampling_params(model_dir: str, mode: str = "auto") -> dict[str, Any]:
    """The defaults to apply, by SamplingParams field name (empty for mode "vllm")."""
    if mode not in MODES:
        raise ValueError(f"--generation-config must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "vllm":
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
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
