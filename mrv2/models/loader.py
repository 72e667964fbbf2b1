"""Loading checkpoints: config, dtype, weights, model.

Two local forms are read (Hub ids are resolved to one of them first, mrv2/models/hub.py):
a Hugging Face directory (config.json + safetensors) and a GGUF file (mrv2/models/gguf/),
whose config, tokenizer and weights all come from the file. Errors are raised before any
weight is read whenever the config alone shows the model cannot be served.
"""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from mrv2 import cpu_caps
from mrv2.config import ModelConfig
from mrv2.models.gguf import (bf16_copy_elements, gguf_hf_config, is_gguf_path,
                              iterate_gguf_weights, open_gguf)
from mrv2.models.multimodal_text import TEXT_MODELS, text_config, text_weights
from mrv2.models.registry import EAGLE3_HEAD_ARCHITECTURES, UnsupportedModelError, get_model_class

if TYPE_CHECKING:
    from mrv2.models.cpu.quantized_weights import PackedModules

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
        raise ModelNotFoundError(f"model path {model_path!r} does not exist")
    if not os.path.isdir(model_path):
        raise ModelNotFoundError(f"model path {model_path!r} is not a directory (nor a "
                                 f".gguf file)")


def load_hf_config(model_path: str, hf_config_path: str | None = None) -> Any:
    """The transformers PretrainedConfig of a model directory or GGUF file; `hf_config_path`
    (a directory holding config.json) wins when given.

    The architecture is checked before transformers builds the config, so an unsupported model
    fails with UnsupportedModelError even when transformers does not know its model_type.
    """
    if hf_config_path is not None:
        config = _directory_config(hf_config_path)
    elif is_gguf_path(model_path):
        config = gguf_hf_config(open_gguf(model_path))
        get_model_class(config.architectures)
    else:
        config = _directory_config(model_path)
    if getattr(config, "per_layer_config", None):
        # Gemma 4's layers override head_dim / num_key_value_heads: mrv2 reads each layer's
        # from `per_layer_config` (kv_cache_layout.layer_kv_shape) and the global value as
        # the model's default (the windowed layers').
        config.allow_global_per_layer_attribute_access = True
    check_quantization_config(config)
    return config


def check_quantization_config(config: Any) -> None:
    """A checkpoint quantized by a method its model class does not load (the class's
    `quantization_methods`, none by default) is refused by name before any weight is read:
    its tensors would load as something else, or not at all."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return
    method = (quant.get("quant_method") if isinstance(quant, dict)
              else getattr(quant, "quant_method", None))
    model_class = get_model_class(getattr(config, "architectures", None))
    allowed = getattr(model_class, "quantization_methods", ())
    if method not in allowed:
        raise ValueError(f"quantization_config quant_method={method!r} is not supported for "
                         f"{model_class.__name__}; supported: {list(allowed) or 'none'}")


def _directory_config(model_path: str) -> Any:
    _check_model_dir(model_path)
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        ggufs = sorted(name for name in os.listdir(model_path) if is_gguf_path(name))
        hint = (f"; it holds GGUF files ({', '.join(ggufs[:3])}): pass the file's path"
                if ggufs else "")
        raise ModelNotFoundError(
            f"{model_path!r} is not a Hugging Face model directory: no config.json{hint}")
    try:
        with open(config_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON ({e})") from None
    # A multimodal checkpoint serves its language model (models/multimodal_text.py); a draft
    # head is built by its speculative method (spec_decode/draft_model.py).
    architectures = raw.get("architectures") or []
    if not architectures or any(a not in EAGLE3_HEAD_ARCHITECTURES for a in architectures):
        get_model_class([TEXT_MODELS.get(a, a) for a in architectures])

    from transformers import AutoConfig  # heavy import, only when a model is loaded

    return text_config(AutoConfig.from_pretrained(model_path))


def _config_dtype(hf_config: Any) -> torch.dtype | None:
    # transformers 5 names it `dtype`; 4.x configs and old config.json use `torch_dtype`.
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).removeprefix("torch."))


# Overrides what dtype="auto" runs on the CPU ("float32", "bfloat16" or "float16"): the test
# suite pins float32, whose references are float32 models.
CPU_AUTO_DTYPE_ENV = "MRV2_CPU_AUTO_DTYPE"


def cpu_auto_dtype() -> torch.dtype:
    """What dtype="auto" runs on the CPU, decided on the machine at run time: bfloat16 where
    the CPU computes it natively (AMX or AVX-512 BF16, with oneDNN: 16-bit weights, the linears
    of a batch on the matrix units), float32 elsewhere (bf16 matmuls there are emulated, orders
    of magnitude slower). bench/README.md has both against each other. `MRV2_CPU_AUTO_DTYPE`
    overrides the choice."""
    forced = os.environ.get(CPU_AUTO_DTYPE_ENV, "").strip().lower()
    if forced:
        if forced not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"{CPU_AUTO_DTYPE_ENV}={forced!r}: expected 'float32', "
                             f"'bfloat16' or 'float16'")
        return _DTYPES[forced]
    from mrv2.models.layers.cpu_linear import computes_natively

    return torch.bfloat16 if computes_natively(torch.bfloat16) else torch.float32


def cpu_auto_gguf(model_path: str, batch_invariant: bool) -> tuple[bool, bool, bool]:
    """For dtype="auto" on the CPU and a GGUF file whose linears are stored quantized or in 16
    bits: (compute on its blocks, i.e. quantization="gguf"; each linear of integer blocks also
    holds a bfloat16 copy, ModelConfig.gguf_bf16_copies; and an int8 copy for a prompt's
    rows, ModelConfig.gguf_int8_prefill).

    Where the machine picks float32 (no 16-bit matrix instructions), the blocks alone: read
    at their own size they beat float32 weights at every batch size measured (Zen 3). Where it
    picks bfloat16, neither wins alone (bench/README.md, Zen 4 and the AMX Xeon: the blocks
    at 1-2 rows, bfloat16 on the matrix units from 8), so a file of integer blocks or F16
    keeps them for a few rows and a bfloat16 copy for more; the blocks alone (memory near the
    file's size) where the copies and the file would take more than half the available
    memory; a BF16 file (a bfloat16 model as it is), or batch-invariant mode, dequantized to
    bfloat16. `MRV2_CPU_AUTO_DTYPE` names a dtype to dequantize to. Beside the bfloat16
    copies, integer blocks hold int8 ones where oneDNN multiplies int8 on VNNI
    (int8_linear.int8_products_run: twice bfloat16's rate on a prompt), unless
    MRV2_GGUF_PREFILL=bf16."""
    if os.environ.get(CPU_AUTO_DTYPE_ENV, "").strip():
        return False, False, False
    if cpu_auto_dtype() == torch.float32:
        return True, False, False
    ckpt = open_gguf(model_path)
    copies = 2 * bf16_copy_elements(ckpt)
    if not copies or batch_invariant:
        return False, False, False
    from mrv2.models.layers import int8_linear

    int8 = int8_linear.int8_products_run() and cpu_caps.caps().gguf_prefill != "bf16"
    int8_bytes = bf16_copy_elements(ckpt, integer_blocks_only=True) if int8 else 0
    file_bytes = sum(os.path.getsize(f) for f in ckpt.files)  # every part of a split file
    budget = available_memory_bytes() // 2 - file_bytes
    return True, copies <= budget, 0 < int8_bytes <= budget - copies


def available_memory_bytes() -> int:
    """The kernel's estimate of the memory available to a new allocation (MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device_type: str) -> torch.dtype:
    """The dtype weights and activations run in.

    "auto": on the CPU `cpu_auto_dtype()` (the machine decides); on CUDA the checkpoint's
    dtype, float32 if the config has none.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; accepted: 'auto', "
                             f"{', '.join(repr(k) for k in _DTYPES)} or the torch dtypes")
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        if device_type != "cuda":
            return cpu_auto_dtype()
        return _config_dtype(hf_config) or torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; accepted: 'auto', "
                         f"{', '.join(repr(k) for k in _DTYPES)}")
    return _DTYPES[name]


def split_cpu_dtype(dtype: torch.dtype, device_type: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(activation dtype, weight dtype or None) for a model resolved to `dtype`: on the CPU a
    bfloat16 / float16 model keeps its linear, embedding and LM-head weights in that dtype and
    computes the rest in float32 (models/cpu attaches it); its linears run on the CPU's 16-bit
    matrix units where it has them (layers/cpu_linear.native_16bit_linear), else widen the
    weights to float32. Measured against the whole model in bfloat16 on an AMX CPU it was
    faster at every batch size (bench/README.md: a step of a few rows runs the fused float32
    decode stack on the 16-bit weights). Everywhere else (dtype, None): one dtype for both."""
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype, None
    return torch.float32, dtype


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


def checkpoint_weights(model_config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (Hugging Face name, lazy tensor) pairs, safetensors or GGUF. Lazy: under
    tensor parallelism each rank reads (or dequantizes) only its shard of each tensor."""
    if is_gguf_path(model_config.model):
        return iterate_gguf_weights(open_gguf(model_config.model), model_config.hf_config)
    safetensors_files(model_config.model)
    weights = iterate_safetensors(model_config.model, lazy=True)
    if getattr(model_config.hf_config, "multimodal_architecture", None):
        return text_weights(weights)
    return weights


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _pack_gguf_blocks(model: nn.Module, model_config: ModelConfig,
                      device: torch.device) -> PackedModules | None:
    """quantization="gguf" on the CPU: give the modules that compute on the file's blocks
    those blocks (models/cpu/quantized_weights decides which), before any weight is loaded:
    their float32 parameters, allocated by torch.empty and never written, are released
    without ever being resident, so the load-time peak follows the file's size. The
    `PackedModules` attached, or None."""
    if model_config.quantization != "gguf" or device.type != "cpu":
        return None
    # Imported here: it pulls in the CPU kernels, which only this path needs.
    from mrv2.models.cpu.quantized_weights import pack_gguf_weights

    return pack_gguf_weights(model, model_config)


def load_model(model_config: ModelConfig, device: torch.device,
               model_class: type[nn.Module] | None = None) -> nn.Module:
    """Build the model for `model_config` on `device` in `model_config.dtype`, fill every
    parameter from the checkpoint (or, quantization="gguf" on the CPU, give its module the
    file's blocks in its place), and return it in eval mode. `model_class`: what to build
    where the config's architecture does not say it (a speculative head); None: the
    architecture's class."""
    if model_config.hf_config is None:
        model_config = dataclasses.replace(model_config,
                                           hf_config=load_hf_config(model_config.model))
    if model_class is None:
        model_class = get_model_class(getattr(model_config.hf_config, "architectures", None))
    # Files are resolved (and a GGUF file parsed) before the model is allocated.
    weights = checkpoint_weights(model_config)
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_class(model_config)
    packed = _pack_gguf_blocks(model, model_config, torch.device(device))
    if packed is not None:  # those tensors are in the packed weights: never dequantized
        weights = ((name, w) for name, w in weights if name not in packed.checkpoint_names)
    loaded = model.load_weights(weights)
    if packed is not None:
        loaded |= packed.parameter_names
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_config.model!r} is missing weights for "
                         f"{len(missing)} parameter(s): {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''} (fused qkv_proj/gate_up_proj "
                         f"need all of q/k/v_proj or gate/up_proj)")
    return model.eval()


__all__ = ["CPU_AUTO_DTYPE_ENV", "ModelNotFoundError", "UnsupportedModelError",
           "check_quantization_config", "checkpoint_weights", "cpu_auto_dtype",
           "available_memory_bytes", "cpu_auto_gguf",
           "iterate_safetensors", "load_hf_config", "load_model", "resolve_dtype",
           "safetensors_files", "split_cpu_dtype"]
