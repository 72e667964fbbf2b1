"""Loading Hugging Face model directories: config, dtype, safetensors weights, model.

Only local directories are read (nothing is downloaded). Errors are raised before any
weight is read whenever the config alone shows the model cannot be served.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from mrv2.config import ModelConfig
from mrv2.models.registry import UnsupportedModelError, get_model_class

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ModelNotFoundError(ValueError):
    """The model path is missing, not a model directory, or has no weights."""


def _check_model_dir(model_path: str) -> None:
    if not os.path.exists(model_path):
        raise ModelNotFoundError(f"model path {model_path!r} does not exist (mrv2 loads local "
                                 f"Hugging Face model directories only)")
    if not os.path.isdir(model_path):
        raise ModelNotFoundError(f"model path {model_path!r} is not a directory")


def load_hf_config(model_path: str) -> Any:
    """The transformers PretrainedConfig of a local model directory.

    The architecture is checked on the raw config.json first, so an unsupported model fails
    with UnsupportedModelError even when transformers does not know its model_type.
    """
    _check_model_dir(model_path)
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelNotFoundError(
            f"{model_path!r} is not a Hugging Face model directory: no config.json")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON ({e})") from None
    get_model_class(raw.get("architectures"))

    from transformers import AutoConfig  # heavy import, only when a model is loaded

    return AutoConfig.from_pretrained(model_path)


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    # transformers 5 names it `dtype`; 4.x configs and old config.json use `torch_dtype`.
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).removeprefix("torch."))


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device_type: str) -> torch.dtype:
    """The dtype weights and activations run in.

    "auto": float32 on CPU (bf16/fp16 matmuls are far slower than fp32 on CPUs without
    native support, DESIGN.md section 5); on CUDA the checkpoint's dtype, float32 if the
    config has none.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; accepted: 'auto', "
                             f"{', '.join(repr(k) for k in _DTYPES)} or the torch dtypes")
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        if device_type != "cuda":
            return torch.float32
        return _config_dtype(hf_config) or torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: 'auto', "
                         f"{', '.join(repr(k) for k in _DTYPES)}")
    return _DTYPES[name]


def safetensors_files(model_path: str) -> list[str]:
    """The weight files of a model directory, single-file or sharded."""
    _check_model_dir(model_path)
    single = os.path.join(model_path, SAFETENSORS_FILE)
    index = os.path.join(model_path, SAFETENSORS_INDEX_FILE)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    raise ModelNotFoundError(f"no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE} in "
                             f"{model_path!r} (only safetensors checkpoints are supported)")


def iterate_safetensors(model_path: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) one tensor at a time, so peak memory is one tensor, not a shard.

    `lazy=True` yields safetensors slices (`get_slice`) instead: nothing is read until a
    weight loader indexes one, so a tensor-parallel rank reads only its rows or columns. A
    slice is valid until the next item is requested.
    """
    from safetensors import safe_open

    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """Build the model for `model_config` on `device` in `model_config.dtype`, fill every
    parameter from the checkpoint, and return it in eval mode."""
    if model_config.hf_config is None:
        model_config = dataclasses.replace(model_config,
                                           hf_config=load_hf_config(model_config.model))
    model_class = get_model_class(getattr(model_config.hf_config, "architectures", None))
    # Files are resolved before the (possibly large) model is allocated.
    safetensors_files(model_config.model)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_class(model_config)
    # Lazy slices: under tensor parallelism each rank reads only its shard of each tensor.
    loaded = model.load_weights(iterate_safetensors(model_config.model, lazy=True))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_config.model!r} is missing weights for "
                         f"{len(missing)} parameter(s): {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''} (fused qkv_proj/gate_up_proj "
                         f"need all of q/k/v_proj or gate/up_proj)")
    return model.eval()


__all__ = ["ModelNotFoundError", "UnsupportedModelError", "iterate_safetensors",
           "load_hf_config", "load_model", "resolve_dtype", "safetensors_files"]
