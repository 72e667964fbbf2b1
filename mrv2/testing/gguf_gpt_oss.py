"""llama.cpp's ``GptOssModel`` (``conversion/gpt_oss.py``) for gguf_writer.py: how the converter
writes a gpt-oss checkpoint's tensors.

  * ``generate_extra_tensors`` + ``repack_mxfp4`` + ``transform_nibble_layout``: an MXFP4
    checkpoint's expert ``*_blocks`` / ``*_scales`` pairs repacked into ggml's MXFP4 blocks
    (the scale byte, then the 16 bytes with the nibbles reordered), gate/up split into their
    rows ``::2`` (gate) and ``1::2`` (up); written first, raw, as the converter's
    ``add_tensor(..., raw_dtype=MXFP4)`` calls run before the other tensors are prepared.
  * ``filter_tensors``: the sinks get a ``.weight`` suffix.
  * ``modify_tensors``: float experts transposed to [E, out, in], gate/up split the same
    way (their biases too); the ``*_blocks`` / ``*_scales`` tensors themselves skipped.

The sliding window and the experts' width (``set_gguf_parameters``) are in gguf_hparams.py.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import gguf
import numpy as np
import torch

MXFP4 = gguf.GGMLQuantizationType.MXFP4


def transform_nibble_layout(tensor: torch.Tensor) -> torch.Tensor:
    """``GptOssModel.transform_nibble_layout``, as written there."""
    assert tensor.dtype == torch.uint8
    assert tensor.shape[-1] == 16
    # swap nibbles
    t_lo = tensor & 0x0F
    t_hi = tensor & 0xF0
    t_swapped = (t_lo << 4) | (t_hi >> 4)
    tensor = t_swapped
    # transform aaaa...bbbb... to abababab...
    blk_a, blk_b = tensor.chunk(2, dim=-1)
    # get a_
    blk_a0 = (blk_a & 0xF0).view(-1, 1)
    blk_a1 = (blk_a << 4).view(-1, 1)
    blk_a = torch.stack((blk_a0, blk_a1), dim=2).view(tensor.shape)
    # get _b
    blk_b0 = (blk_b >> 4).view(-1, 1)
    blk_b1 = (blk_b & 0x0F).view(-1, 1)
    blk_b = torch.stack((blk_b0, blk_b1), dim=2).view(tensor.shape)
    # swap once more
    out = blk_a | blk_b
    out_h = out & 0xF0
    out_l = out & 0x0F
    out = (out_h >> 4) | (out_l << 4)
    return out


def repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """``GptOssModel.repack_mxfp4``: [E, rows, G, 16] blocks and [E, rows, G] scales ->
    uint8 [E, rows, G * 17], a GGUF MXFP4 tensor's bytes."""
    assert blocks.dtype == torch.uint8
    assert scales.dtype == torch.uint8
    scales = scales.unsqueeze(-1)
    assert len(blocks.shape) == 4
    assert len(scales.shape) == 4
    blocks = transform_nibble_layout(blocks)
    new_data = torch.concat((scales, blocks), dim=-1)
    new_data = new_data.view(new_data.shape[0], new_data.shape[1],
                             new_data.shape[2] * new_data.shape[3])
    return new_data.numpy()


def mxfp4_experts(tensors: Iterable[tuple[str, torch.Tensor]], tensor_map: Any
                  ) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """``generate_extra_tensors``: (GGUF name, bytes, MXFP4) of every expert tensor stored as
    MXFP4, in the converter's order (the checkpoint's, blocks before their scales)."""
    out = []
    blocks0 = blocks1 = torch.zeros(1)
    for name, data in tensors:  # "we assume that tensors are loaded in the correct order"
        if "mlp.experts.down_proj_blocks" in name:
            blocks0 = data
        elif "mlp.experts.down_proj_scales" in name:
            new_name = tensor_map.get_name(name.replace("_scales", ".weight"),
                                           try_suffixes=(".weight", ".bias"))
            out.append((new_name, repack_mxfp4(blocks0, data), MXFP4))
        elif "mlp.experts.gate_up_proj_blocks" in name:
            blocks0, blocks1 = data[:, ::2, :, :], data[:, 1::2, :, :]
        elif "mlp.experts.gate_up_proj_scales" in name:
            scales0, scales1 = data[:, ::2, :], data[:, 1::2, :]
            for proj, blocks, scales in (("gate_proj", blocks0, scales0),
                                         ("up_proj", blocks1, scales1)):
                new_name = tensor_map.get_name(
                    name.replace("gate_up_proj_scales", f"{proj}.weight"),
                    try_suffixes=(".weight", ".bias"))
                out.append((new_name, repack_mxfp4(blocks, scales), MXFP4))
    return out


def modified_tensors(tensors: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """``filter_tensors`` + ``modify_tensors``: the tensors the generic steps then map."""
    for name, data in tensors:
        if "sinks" in name:
            name += ".weight"
        if "down_proj" in name:
            if name.endswith("_bias"):
                name = name.replace("down_proj_bias", "down_proj.bias")
            elif "_blocks" not in name and "_scales" not in name:
                name = name.replace("down_proj", "down_proj.weight")
                data = data.transpose(-1, -2)
            else:
                continue  # written by mxfp4_experts
        if "gate_up_proj" in name:
            if name.endswith("_bias"):
                yield name.replace("gate_up_proj_bias", "gate_proj.bias"), data[..., ::2]
                yield name.replace("gate_up_proj_bias", "up_proj.bias"), data[..., 1::2]
            elif "_blocks" not in name and "_scales" not in name:
                data = data.transpose(-1, -2)
                yield name.replace("gate_up_proj", "gate_proj.weight"), data[:, ::2, :]
                yield name.replace("gate_up_proj", "up_proj.weight"), data[:, 1::2, :]
        else:
            yield name, data
