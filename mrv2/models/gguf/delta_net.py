"""Qwen3-Next and Qwen3.5 (dense, MoE) GGUF tensors as the Hugging Face tensors they were
converted from: what llama.cpp's converter (conversion/qwen.py: `Qwen3NextModel`, and
`_LinearAttentionVReorderBase` for Qwen3.5) changed, undone here, per tensor:

- every RMSNorm weight but the delta rule's gated one (`ssm_norm`) is stored as 1 + w (the
  layer norms, q/k norms, the final norm, the MTP block's): read back as stored - 1, which
  the model's 1 + w turns into the stored value bit for bit (weight_views.GGUFWeight);
- A_log is stored as `ssm_a` = -exp(A_log), named without a .weight suffix: read back as
  log(-ssm_a), the float32 whose exp is -ssm_a again where one is (the model reads A_log only
  through exp, so its decay is the file's own);
- dt_bias is stored renamed `ssm_dt.bias`, the [C, 1, K] convolution squeezed to [C, K]
  (`ssm_conv1d`, kept F32): named and shaped back;
- Qwen3-Next's in_proj_qkvz (rows per key head: its q, its k, then its value heads' v and z)
  is split into `attn_qkv` (every head's q, then k, then v) and `attn_gate` (z): the two
  are held until both are read and their rows interleaved back per key head (whole rows
  move, so a quantized file keeps its blocks). An older converter's `ssm_in` (in_proj_qkvz as
  it is) reads as it is; in_proj_ba is `ssm_ba` unchanged;
- Qwen3.5 with fewer key heads than value heads: every value-head-indexed tensor has its
  value heads reordered from grouped by key head (k0's v0, v1, ..., k1's v0, ...) to tiled
  (v0 of every key head, then v1, ...): the v rows of `attn_qkv` (in_proj_qkv), `attn_gate`
  (in_proj_z), `ssm_beta` / `ssm_alpha` (in_proj_b / _a), `ssm_a`, `ssm_dt`, the v channels of
  `ssm_conv1d`, and the input columns of `ssm_out` (out_proj). Grouped again here: rows move
  whole; out_proj's columns move in runs of a value head's width, whole blocks where that is
  a multiple of the type's block size (Q8_0 / Q4_0 for 128-wide heads), else dequantized;
- multi-token-prediction blocks, appended after the decoder's (blk.{L + i}.*, `nextn.*`),
  are named as the checkpoint's `mtp.*` tensors, which the model skips (it refuses
  speculative decoding);
- attention (q with its output gate per head, k, v, o), the routers, the shared expert and its
  gate, the dense MLP: renamed only; the experts: one 2-D tensor each (weights.py).

A tensor of a linear-attention leaf in a full-attention layer, or of the other model's form
(`ssm_ba` in a Qwen3.5 file, ...), has no counterpart and is refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import torch

from mrv2.models.gguf.checkpoint import GGUFCheckpoint, GGUFError, GGUFTensorRecord
from mrv2.models.gguf.weight_views import DerivedWeight, GGUFWeight

Mapped = list[tuple[str, GGUFWeight]]
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
# Norm tensors stored as 1 + w (not ssm_norm: the converter leaves linear_attn.norm as is).
_SHIFTED_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                  "attn_k_norm.weight", "output_norm.weight", "nextn.enorm.weight",
                  "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
# A linear-attention layer's file tensors -> its Hugging Face tensor under linear_attn.
_LINEAR_LEAVES = {"ssm_a": "A_log", "ssm_dt.bias": "dt_bias", "ssm_conv1d.weight":
                  "conv1d.weight", "ssm_norm.weight": "norm.weight",
                  "ssm_out.weight": "out_proj.weight", "attn_qkv.weight": "in_proj_qkv.weight",
                  "attn_gate.weight": "in_proj_z.weight"}
_ARCH_LEAVES = {"qwen3next": {"ssm_ba.weight": "in_proj_ba.weight",
                              "ssm_in.weight": "in_proj_qkvz.weight"},
                "qwen35": {"ssm_beta.weight": "in_proj_b.weight",
                           "ssm_alpha.weight": "in_proj_a.weight"}}
_ARCH_LEAVES["qwen35moe"] = _ARCH_LEAVES["qwen35"]
# The MTP block's own tensors (`model.layers.{L}.<hf>` in the converter) -> the checkpoint's.
_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight",
          "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
          "nextn.shared_head_norm.weight": "mtp.norm.weight"}


def grouped_from_tiled(key_heads: int, value_heads: int, width: int) -> np.ndarray:
    """Index of each grouped row in the tiled order: grouped row (h, g, d) (value head g of
    key head h, element d of `width`) is tiled row (g, h, d)."""
    tiled = np.arange(value_heads * width).reshape(value_heads // key_heads, key_heads, width)
    return tiled.transpose(1, 0, 2).reshape(-1)


def a_log_from_ssm_a(ssm_a: np.ndarray) -> np.ndarray:
    """A_log from the stored -exp(A_log): log(-ssm_a), moved by an ulp where that float32's
    exp is not -ssm_a and a neighbour's is."""
    target = torch.from_numpy(np.array(-ssm_a, dtype=np.float32))
    if not bool((target > 0).all()):
        raise GGUFError("ssm_a holds a value >= 0; the converter writes -exp(A_log) < 0")
    best = torch.log(target.double()).float()
    for towards in (float("inf"), float("-inf")):
        neighbour = torch.nextafter(best, torch.full_like(best, towards))
        best = torch.where((best.exp() != target) & (neighbour.exp() == target), neighbour,
                           best)
    return best.numpy()


class DeltaNetTensors:
    """The Hugging Face tensors of one Qwen3-Next / Qwen3.5 file tensor at a time (see the
    module docstring); `mapped(name, record)` is the generic mapping (weights.py)."""

    def __init__(self, ckpt: GGUFCheckpoint, hf_config: Any, trunk_layers: int,
                 mapped: Callable[[str, GGUFTensorRecord], Mapped]) -> None:
        self.arch, self.mapped, self.trunk = ckpt.architecture, mapped, trunk_layers
        self.layer_types = list(hf_config.layer_types)
        self.k_heads = hf_config.linear_num_key_heads
        self.v_heads = hf_config.linear_num_value_heads
        self.k_dim, self.v_dim = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
        self.architecture = hf_config.architectures[0]
        # Qwen3-Next: a layer's attn_qkv or attn_gate (name, record), held until the other is
        # read.
        self.held: dict[int, tuple[str, GGUFTensorRecord]] = {}

    def _refuse(self, name: str, record: GGUFTensorRecord, why: str = "") -> GGUFError:
        return GGUFError(f"{record.file}: tensor {name!r} has no counterpart in a "
                         f"{self.architecture} model{why}")

    def weights(self, name: str, record: GGUFTensorRecord) -> Mapped:
        """(Hugging Face name, weight) pairs of the file tensor `name`: none while it is
        held."""
        match = _LAYER_TENSOR.match(name)
        layer, leaf = (int(match[1]), match[2]) if match else (None, name)
        if layer is not None and layer >= self.trunk:
            return self._mtp(name, record, layer, leaf)
        leaves = {**_LINEAR_LEAVES, **_ARCH_LEAVES[self.arch]}
        if leaf not in leaves:
            return self._shifted(record, leaf, self.mapped(name, record))
        if layer is None or self.layer_types[layer] != "linear_attention":
            raise self._refuse(name, record, " (a linear-attention tensor outside a "
                                             "linear-attention layer; --fuse-qkv files are not "
                                             "supported)")
        if self.arch == "qwen3next" and leaf in ("attn_qkv.weight", "attn_gate.weight"):
            return self._qkvz(name, record, layer)
        hf_name = f"model.layers.{layer}.linear_attn.{leaves[leaf]}"
        return [(hf_name, self._linear(name, record, leaf, hf_name))]

    def check_done(self) -> None:
        """Every held tensor was paired (a Qwen3-Next layer has attn_qkv and attn_gate)."""
        for name, record in self.held.values():
            raise self._refuse(name, record, " without its attn_qkv / attn_gate pair")

    def _shifted(self, record: GGUFTensorRecord, leaf: str, pairs: Mapped) -> Mapped:
        if leaf not in _SHIFTED_NORMS:
            return pairs
        return [(name, GGUFWeight(record, offset=-1.0)) for name, _ in pairs]

    def _mtp(self, name: str, record: GGUFTensorRecord, layer: int, leaf: str) -> Mapped:
        """An MTP block's tensor under its checkpoint name (mtp.layers.{i}.*, mtp.fc, ...)."""
        if leaf.startswith("nextn."):
            if leaf not in _NEXTN or layer != self.trunk:
                raise self._refuse(name, record)
            return self._shifted(record, leaf, [(_NEXTN[leaf], GGUFWeight(record))])
        prefix = f"model.layers.{layer}."
        return [(f"mtp.layers.{layer - self.trunk}.{hf.removeprefix(prefix)}", weight)
                for hf, weight in self._shifted(record, leaf, self.mapped(name, record))]

    def _v_rows(self, width: int) -> np.ndarray | None:
        """Qwen3.5's grouped-from-tiled row index of a value-head-indexed segment (None:
        stored grouped already, as Qwen3-Next's, or one value head per key head)."""
        if self.arch == "qwen3next" or self.k_heads == self.v_heads:
            return None
        return grouped_from_tiled(self.k_heads, self.v_heads, width)

    def _qkv_rows(self) -> np.ndarray | None:
        """in_proj_qkv's (and the convolution's) rows: q and k as stored, v grouped."""
        v_rows = self._v_rows(self.v_dim)
        key = self.k_heads * self.k_dim
        return None if v_rows is None else np.concatenate([np.arange(2 * key), 2 * key + v_rows])

    def _linear(self, name: str, record: GGUFTensorRecord, leaf: str, hf_name: str
                ) -> GGUFWeight:
        """One linear-attention tensor (not Qwen3-Next's qkv / gate pair), checked and undone."""
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        rows: np.ndarray | None = None
        runs: tuple[int, np.ndarray] | None = None
        values: Callable[[np.ndarray], np.ndarray] | None = None
        shape = record.shape
        if leaf in ("ssm_a", "ssm_dt.bias", "ssm_beta.weight", "ssm_alpha.weight"):
            expected, rows = self.v_heads, self._v_rows(1)
            values = a_log_from_ssm_a if leaf == "ssm_a" else None
        elif leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            expected, rows = 2 * key + value, self._qkv_rows()
            if leaf == "ssm_conv1d.weight":
                shape = (shape[0], 1, *shape[1:])  # back to conv1d's [C, 1, K]
        elif leaf == "attn_gate.weight":
            expected, rows = value, self._v_rows(self.v_dim)
        elif leaf == "ssm_out.weight":
            expected, heads = shape[0], self._v_rows(1)
            if shape[1:] != (value,):
                raise GGUFError(f"{record.file}: {name} has shape {shape}, input "
                                f"width {value} expected")
            runs = None if heads is None else (self.v_dim, heads)
        elif leaf == "ssm_ba.weight":
            expected = 2 * self.v_heads
        elif leaf == "ssm_in.weight":
            expected = 2 * key + 2 * value
        else:  # ssm_norm: one value head's width
            expected = self.v_dim
        if shape[0] != expected:
            raise GGUFError(f"{record.file}: {name} has {shape[0]} rows, {expected} "
                            f"expected from the ssm.* keys")
        if rows is None and runs is None and values is None and shape == record.shape:
            return GGUFWeight(record)
        return DerivedWeight(hf_name, [record], shape, rows, runs, values)

    def _qkvz(self, name: str, record: GGUFTensorRecord, layer: int) -> Mapped:
        """Qwen3-Next's in_proj_qkvz from a layer's attn_qkv and attn_gate (whichever came
        second completes it): per key head its q, k, then its value heads' v and z rows."""
        held = self.held.pop(layer, None)
        if held is None:
            self.held[layer] = (name, record)
            return []
        pair = sorted([held, (name, record)], key=lambda p: not p[0].endswith("attn_qkv.weight"))
        (_, qkv), (_, gate) = pair
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        for (part_name, part), rows in zip(pair, (2 * key + value, value)):
            if part.shape[0] != rows or part.shape[1:] != qkv.shape[1:]:
                raise GGUFError(f"{part.file}: {part_name} has shape {part.shape}, {rows} "
                                f"rows of the attn_qkv's width expected")
        group = value // self.k_heads  # one key head's value-head rows
        stacked = 2 * key + value  # attn_gate's first row in the stack
        rows = np.concatenate([np.concatenate([
            h * self.k_dim + np.arange(self.k_dim), key + h * self.k_dim + np.arange(self.k_dim),
            2 * key + h * group + np.arange(group), stacked + h * group + np.arange(group)])
            for h in range(self.k_heads)])
        hf_name = f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight"
        return [(hf_name, DerivedWeight(hf_name, [qkv, gate], (len(rows), *qkv.shape[1:]),
                                        rows))]
