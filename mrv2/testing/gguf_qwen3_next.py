"""llama.cpp's ``Qwen3NextModel``, ``Qwen3_5TextModel`` and ``Qwen3_5MoeTextModel``
(``conversion/qwen.py``) for gguf_writer.py: how the converter writes Qwen3-Next and Qwen3.5
(dense, MoE) checkpoints.

  * ``_LinearAttentionVReorderBase.modify_tensors`` (Qwen3.5 only, where a key head serves
    several value heads): every value-head-indexed linear-attention tensor reordered from
    grouped by key head to tiled (value head g of every key head, for g = 0, 1, ...): the v rows
    of ``in_proj_qkv``, ``in_proj_z``'s rows, ``in_proj_b`` / ``in_proj_a``'s, ``A_log`` and
    ``dt_bias``, the convolution's v channels, ``out_proj``'s input columns;
  * ``Qwen3NextModel.modify_tensors``: A_log -> -exp(A_log); dt_bias renamed dt_proj.bias; the
    convolution squeezed to [C, K]; every ``*norm.weight`` but ``linear_attn.norm`` + 1;
    ``in_proj_qkvz`` (Qwen3-Next: rows per key head q, k, v, z) split into ``attn_qkv`` (all
    q, all k, all v) and ``attn_gate`` (all z), named as GGUF tensors directly;
  * ``set_gguf_parameters`` (with ``Qwen2MoeModel``'s expert widths, in gguf_hparams.py):
    the ``ssm.*`` shape keys, the recurrent layer flags, full_attention_interval, the rotary
    dimension (head_dim x partial_rotary_factor, 0.25 by default) and, for Qwen3.5, the
    multimodal rope sections ([11, 11, 10, 0] when the checkpoint has none).

The experts are merged by gguf_writer.ExpertMerger (``Qwen2MoeModel.modify_tensors``) and the
convolution kept F32 by its type rule (``SSM_CONV1D`` among the F32 tensors).

Deliberate difference: the multi-token-prediction head. The converter appends it as extra
blocks unless ``--no-mtp``, and refuses (an assertion) a checkpoint whose config names no MTP
layers and which holds no ``mtp.*`` tensors unless ``--no-mtp`` is given; the tiny models have
none, so what is written here is ``--no-mtp``'s output (block_count = the decoder's layers, no
nextn_predict_layers key).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import gguf
import torch

# HF architecture -> GGUF architecture, as the converter registers them.
QWEN3_NEXT_ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "Qwen3NextForCausalLM": gguf.MODEL_ARCH.QWEN3NEXT,
    "Qwen3_5ForCausalLM": gguf.MODEL_ARCH.QWEN35,
    "Qwen3_5MoeForCausalLM": gguf.MODEL_ARCH.QWEN35MOE,
}
_QWEN35_DEFAULT_SECTIONS = [11, 11, 10, 0]
_RECURRENT_LAYERS_KEY = "{arch}.attention.recurrent_layers"  # not in the venv's gguf.Keys


def _tiled(data: torch.Tensor, dim: int, key_heads: int, width: int) -> torch.Tensor:
    """`data` with its value heads along `dim` (each `width` wide) moved from grouped by key
    head to tiled order."""
    shape = list(data.shape)
    grouped = data.reshape(*shape[:dim], key_heads, -1, width, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _tile_value_heads(name: str, data: torch.Tensor, hparams: dict[str, Any]) -> torch.Tensor:
    """Qwen3.5's value-head reordering of one linear-attention tensor."""
    key_heads = hparams["linear_num_key_heads"]
    v_dim, key = hparams["linear_value_head_dim"], key_heads * hparams["linear_key_head_dim"]
    if ".in_proj_qkv." in name or ".conv1d" in name:
        if ".conv1d" in name:
            data = data.squeeze()
        return torch.cat([data[:2 * key], _tiled(data[2 * key:], 0, key_heads, v_dim)])
    if ".in_proj_z." in name:
        return _tiled(data, 0, key_heads, v_dim)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _tiled(data, 0, key_heads, 1)
    if ".A_log" in name or ".dt_bias" in name:  # [Hv], or heads along the last dim
        return _tiled(data, data.ndim - 1, key_heads, 1)
    if ".out_proj." in name:
        return _tiled(data, 1, key_heads, v_dim)
    return data


def _split_qkvz(data: torch.Tensor, hparams: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj_qkvz's rows (per key head: q, k, its value heads' v, z) -> (q, k, v rows of
    every head in turn, z rows)."""
    key_heads, k_dim = hparams["linear_num_key_heads"], hparams["linear_key_head_dim"]
    group = hparams["linear_num_value_heads"] // key_heads * hparams["linear_value_head_dim"]
    per_head = data.reshape(key_heads, 2 * k_dim + 2 * group, data.shape[-1])
    q, k, v, z = per_head.split([k_dim, k_dim, group, group], dim=1)
    flat = [part.reshape(-1, data.shape[-1]) for part in (q, k, v, z)]
    return torch.cat(flat[:3]).contiguous(), flat[3].contiguous()


def qwen3_next_tensors(tensors: Iterable[tuple[str, torch.Tensor]], hparams: dict[str, Any],
                     arch: gguf.MODEL_ARCH) -> Iterator[tuple[str, torch.Tensor]]:
    """``modify_tensors`` of the three classes, before the generic steps map the names."""
    reorder = (arch != gguf.MODEL_ARCH.QWEN3NEXT
               and hparams["linear_num_key_heads"] != hparams["linear_num_value_heads"])
    for name, data in tensors:
        if data.dtype not in (torch.float16, torch.float32):  # prepare_tensors' first step
            data = data.to(torch.float32)
        if reorder and "linear_attn." in name:
            data = _tile_value_heads(name, data, hparams)
        if name.endswith(".A_log"):
            data = -torch.exp(data)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        if "in_proj_qkvz.weight" in name:
            layer = int(name.split(".")[2])
            qkv, z = _split_qkvz(data, hparams)
            yield f"blk.{layer}.attn_qkv.weight", qkv
            yield f"blk.{layer}.attn_gate.weight", z
        else:
            yield name, data


def rope_dimension_sections(hparams: dict[str, Any]) -> list[int] | None:
    """``TextModel.set_gguf_parameters``' multimodal rope sections (padded to 4), or None."""
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    if "mrope_section" not in rope:
        return None
    sections = list(rope["mrope_section"])
    return (sections + [0] * (4 - len(sections)))[:4]


def add_qwen3_next_hparams(writer: gguf.GGUFWriter, hparams: dict[str, Any],
                           arch: gguf.MODEL_ARCH) -> None:
    """``Qwen3NextModel.set_gguf_parameters``' own keys, then ``_Qwen35MRopeMixin``'s."""
    layers = hparams["num_hidden_layers"]
    writer.add_ssm_conv_kernel(hparams["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hparams["linear_key_head_dim"])
    writer.add_ssm_group_count(hparams["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hparams["linear_num_value_heads"])
    writer.add_ssm_inner_size(hparams["linear_value_head_dim"]
                              * hparams["linear_num_value_heads"])
    if (layer_types := hparams.get("layer_types")) is not None:
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected "
                             f"num_hidden_layers ({layers})")
        writer.add_array(_RECURRENT_LAYERS_KEY.format(arch=writer.arch),
                         [kind == "linear_attention" for kind in layer_types])
    writer.add_full_attention_interval(hparams.get("full_attention_interval", 4))
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hparams.get("partial_rotary_factor", 0.25))
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    writer.add_rope_dimension_count(int(head_dim * partial))
    if arch != gguf.MODEL_ARCH.QWEN3NEXT and "mrope_section" not in rope:
        writer.add_rope_dimension_sections(_QWEN35_DEFAULT_SECTIONS)
