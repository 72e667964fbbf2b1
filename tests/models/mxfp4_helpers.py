"""A reference MXFP4 quantizer (the OCP microscaling spec's: a group's shared exponent is
floor(log2(max |w|)) - 2, e2m1's largest exponent; each value rounded to the nearest e2m1
value, clipped to +-6), and tiny gpt-oss checkpoints quantized with it: the MXFP4 one as the
released checkpoints store their experts, and its float twin holding exactly the values the
MXFP4 one dequantizes to (transformers' reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mrv2.models.mxfp4 import E8M0_BIAS, FP4_VALUES, dequantize


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8
    [..., K/32]) in the checkpoint's layout (input 2j in a byte's low nibble)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp_min(-E8M0_BIAS)  # e8m0's least
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # +0 before -0
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)


def mxfp4_checkpoints(float_dir: Path, root: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its float twin) of a tiny gpt-oss float checkpoint, under
    `root`: every expert weight ([E, in, out]) quantized over its inputs."""
    quantized_dir, twin_dir = root / "mxfp4", root / "mxfp4-twin"
    for out in (quantized_dir, twin_dir):
        shutil.copytree(float_dir, out)
    state = load_file(str(float_dir / "model.safetensors"))
    quantized, twin = {}, {}
    for name, tensor in state.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = twin[name] = tensor
            continue
        blocks, scales = quantize(tensor.transpose(1, 2))  # [E, out, in]: groups of inputs
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        twin[name] = dequantize(blocks, scales).transpose(1, 2).contiguous()
    save_file(quantized, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config_file = quantized_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    config_file.write_text(json.dumps(config))
    return quantized_dir, twin_dir
