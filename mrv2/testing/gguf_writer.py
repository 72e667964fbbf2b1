"""Write a Hugging Face model directory as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does.

The GGUF loader is tested against these files, so they must carry every change the converter
makes to a checkpoint. This module ports the converter's steps for the archs mrv2 builds (llama,
mistral, qwen2, qwen3, gemma2, gemma3, gemma4, phi3, smollm3, olmo2, mistral3, and the MoE
ones qwen2moe, qwen3moe, olmoe and Mixtral as llama, gpt-oss, and the hybrid qwen3next,
qwen35 and qwen35moe; converter classes
``LlamaModel``, ``Qwen2Model``, ``Qwen3Model``, ``Gemma2Model``, ``Gemma3Model``,
``Gemma4Model``, ``Phi3MiniModel``, ``SmolLM3Model``, ``Olmo2Model``, ``Mistral3Model``,
``Qwen2MoeModel``, ``Qwen3MoeModel``, ``OlmoeModel``, ``GptOssModel`` (gguf_gpt_oss.py),
``Qwen3NextModel``, ``Qwen3_5TextModel``, ``Qwen3_5MoeTextModel`` (gguf_qwen3_next.py) in
``conversion/``;
the vocabulary in gguf_vocab.py, the hyperparameter keys in gguf_hparams.py) and serialises
with the ``gguf`` package's ``GGUFWriter``; nothing here encodes GGUF bytes itself.
Reference: llama.cpp as vendored in llama-cpp-python 0.3.36 (gguf-py 0.19.0).

Reproduced, by converter function:
  * ``get_model_architecture`` / ``@ModelBase.register``: Llama and Mistral -> ``llama``, Qwen2 ->
    ``qwen2``, Qwen3 -> ``qwen3`` (and so on; SmolLM3 is a LlamaModel, permuted);
    ``ModelBase.load_hparams``: hparams = AutoConfig(...).to_dict().
  * ``index_tensors``: parts in sorted file order, tensors sorted by name within a part.
  * ``LlamaModel.modify_tensors`` + ``LlamaModel.permute``: llama/mistral q_proj (n_head) and
    k_proj (n_kv_head) weights and biases are permuted to llama.cpp's rotary layout; qwen is not.
  * ``ModelBase.modify_tensors`` / ``map_tensor_name``: names via ``gguf.get_tensor_name_map``.
  * The MoE classes' ``modify_tensors``: a layer's per-expert tensors merged into one 3-D tensor
    per projection once all arrived (``ExpertMerger``); the routers kept F32.
    A tied checkpoint has no lm_head tensor, so the file has no ``output.weight``.
  * ``LlamaModel.generate_extra_tensors``: llama3 rope scaling adds ``rope_freqs.weight`` (F32),
    written first, as the converter's ``chain(generate_extra_tensors(), get_tensors())`` does;
    ``Phi3MiniModel``'s: LongRoPE's ``rope_factors_long`` / ``rope_factors_short``. Phi-3's
    fused ``qkv_proj`` / ``gate_up_proj`` are written whole (``attn_qkv``, ``ffn_up``).
  * ``ModelBase.prepare_tensors``: 1-D tensors, ``*_norm.weight`` and non-``.weight`` tensors are
    F32; other tensors get the requested type; a ``gguf.QuantError`` (row length not a multiple of
    the block size) falls back to F16, as the converter's ``except gguf.QuantError`` does.
  * ``TextModel.set_gguf_parameters`` (+ ``LlamaModel``'s vocab_size and rope.dimension_count):
    hyperparameters, rope scaling keys (linear, yarn; llama3 only via rope_freqs), key/value_length
    whenever the config has ``head_dim``, file_type. ``ModelBase.prepare_metadata``: general.type,
    ``gguf.Metadata`` (general.name = directory name, size_label), quantization_version.
  * ``TextModel._set_vocab_gpt2`` + ``get_vocab_base``: tokens, NORMAL/CONTROL/USER_DEFINED/UNUSED
    types, ``[PAD{i}]`` past the tokenizer's vocab, merges, special ids, add_bos, chat template (the
    last four through ``gguf.SpecialVocab`` itself, as the converter does).

Deliberate differences:
  * Gemma 4's vocabulary: the converter reads it with ``gguf.LlamaHfVocab`` (a sentencepiece-
    style BPE tokenizer.json) and writes tokenizer model "gemma4"; the tiny models' byte-level
    BPE is written as the GPT2 vocabulary, as Gemma 3's is when it has no tokenizer.model.
  * Phi-3's vocabulary: the converter writes a GPT2 (BPE) vocabulary only for a tokenizer_config
    naming GPT2Tokenizer (Phi-4-mini) and reads tokenizer.model (SentencePiece) otherwise; the
    tiny models have only a BPE tokenizer.json, so it is written as the GPT2 vocabulary.
  * ``tokenizer.ggml.pre``: the converter hashes the tokenization of a probe string and raises
    NotImplementedError for any tokenizer it has not been taught (mrv2's locally trained one is
    never known). We name the pre-tokenizer the tokenizer.json pipeline actually is (see
    :func:`bpe_pre_name`), which is the name the converter's table gives real models with the same
    pipeline and what llama.cpp and transformers read to choose the split regex.
  * Types past the converter's --outtype choices (Q4_0, Q4_1, Q5_0, Q5_1) are written the same way
    as its Q8_0 (``gguf.quants.quantize`` for every eligible tensor); llama-quantize would instead
    keep some tensors (e.g. output.weight) at a higher type. K-quants are not offered: gguf 0.19's
    quants.py can dequantize them but not quantize them.
  * Splits: the shard boundaries are chosen here so that exactly ``num_splits`` files come out
    (``GGUFWriter``'s ``split_max_tensors`` cannot give every count, e.g. 8 files of 21 tensors);
    names, ``split.*`` keys and metadata-in-the-first-file-only are GGUFWriter's (gguf-split's).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from safetensors import safe_open

from mrv2.testing.gguf_hparams import (BLOCK_COUNT_KEYS, LLAMA_MODEL_ARCHS, add_hparams,
                                       find_hparam, gemma4_rope_freqs, phi3_rope_dims,
                                       rope_parameters)
from mrv2.testing.gguf_vocab import add_vocab
from mrv2.testing import gguf_gpt_oss, gguf_qwen3_next

# Requested type -> (tensor type, general.file_type). Only types gguf.quants.quantize implements.
_GGML_TYPE_OF: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "Q5_0": (gguf.GGMLQuantizationType.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": (gguf.GGMLQuantizationType.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
}
WRITABLE_TYPES: tuple[str, ...] = tuple(_GGML_TYPE_OF)

# HF architecture -> (GGUF arch, undo_permute), as the converter's registered classes set them.
_GGUF_ARCH_OF: dict[str, tuple[gguf.MODEL_ARCH, bool]] = {
    "LlamaForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "MistralForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": (gguf.MODEL_ARCH.QWEN2, False),
    "Qwen3ForCausalLM": (gguf.MODEL_ARCH.QWEN3, False),
    "Gemma2ForCausalLM": (gguf.MODEL_ARCH.GEMMA2, False),
    "Gemma3ForCausalLM": (gguf.MODEL_ARCH.GEMMA3, False),
    "Phi3ForCausalLM": (gguf.MODEL_ARCH.PHI3, False),
    "SmolLM3ForCausalLM": (gguf.MODEL_ARCH.SMOLLM3, True),
    "Olmo2ForCausalLM": (gguf.MODEL_ARCH.OLMO2, False),
    "Ministral3ForCausalLM": (gguf.MODEL_ARCH.MISTRAL3, True),
    "Gemma4ForCausalLM": (gguf.MODEL_ARCH.GEMMA4, False),
    "Qwen3MoeForCausalLM": (gguf.MODEL_ARCH.QWEN3MOE, False),
    "Qwen2MoeForCausalLM": (gguf.MODEL_ARCH.QWEN2MOE, False),
    "OlmoeForCausalLM": (gguf.MODEL_ARCH.OLMOE, False),
    "MixtralForCausalLM": (gguf.MODEL_ARCH.LLAMA, True),
    "GptOssForCausalLM": (gguf.MODEL_ARCH.GPT_OSS, False),
    **{hf: (arch, False) for hf, arch in gguf_qwen3_next.QWEN3_NEXT_ARCHS.items()},
}
_GEMMA = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
# Gemma3Model.modify_tensors' steps that Gemma4Model inherits (OOV embedding rows dropped).
_GEMMA3_FAMILY = (gguf.MODEL_ARCH.GEMMA3, gguf.MODEL_ARCH.GEMMA4)

def permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """``LlamaModel.permute``: rows of each head go from HF's half-split rotary layout (the first
    half of a head's dims pairs with the second half) to llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def load_hparams(model_dir: Path) -> dict[str, Any]:
    """``ModelBase.load_hparams`` + ``TextModel.__init__``'s text_config merge."""
    from transformers import AutoConfig

    hparams = AutoConfig.from_pretrained(model_dir, trust_remote_code=False).to_dict()
    if "text_config" in hparams:
        hparams = {**hparams, **hparams["text_config"]}
    return hparams


def llama3_rope_factors(hparams: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor | None:
    """``LlamaModel.generate_extra_tensors``: the per-frequency divisors of llama3 rope scaling
    (the ``rope_freqs.weight`` tensor), or None when the rope is not llama3."""
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    factors: list[Any] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def phi3_rope_factors(hparams: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``Phi3MiniModel.generate_extra_tensors``: LongRoPE's long and short factors (F32), for a
    config that has them."""
    rope = rope_parameters(hparams)
    long_factors, short_factors = rope.get("long_factor"), rope.get("short_factor")
    if not long_factors:
        return []
    if short_factors is None:
        raise KeyError("Missing the required key rope_scaling.long_factor or "
                       "rope_scaling_short_factor")
    if len(long_factors) != len(short_factors) or len(long_factors) != phi3_rope_dims(hparams) / 2:
        raise ValueError(f"The length of rope long and short factors must be "
                         f"{phi3_rope_dims(hparams) / 2}")
    return [(gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(factors, dtype=torch.float32))
            for tensor, factors in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, long_factors),
                                    (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, short_factors))]


def _hf_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``index_tensors`` order: part files sorted (from the index when there is one), tensors
    sorted by name within a part."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        parts = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        parts = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    if not parts:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for part in parts:
        with safe_open(str(model_dir / part), "pt") as st:
            for name in sorted(st.keys()):
                yield name, st.get_tensor(name)


# Matrices prepare_tensors keeps in F32 (the MoE routers, the delta rule's convolution).
_F32_MATRICES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _tensor_type(new_name: str, n_dims: int, types: dict[str, gguf.GGMLQuantizationType]
                 ) -> gguf.GGMLQuantizationType:
    """``prepare_tensors``' type choice; `types`: name ending -> type, the first that matches."""
    if (n_dims <= 1 or new_name.endswith(("_norm.weight", *_F32_MATRICES))
            or not new_name.endswith(".weight")):
        return gguf.GGMLQuantizationType.F32  # llama.cpp reads norms, biases and rope_freqs as F32
    return next(t for end, t in types.items() if new_name.endswith(end))


def _convert_tensors(model_dir: Path, hparams: dict[str, Any], arch: gguf.MODEL_ARCH,
                     undo_permute: bool, types: dict[str, gguf.GGMLQuantizationType],
                     ) -> list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """``prepare_tensors``: every tensor as (GGUF name, data, type), in the converter's order."""
    tensor_map = gguf.get_tensor_name_map(arch, find_hparam(hparams, BLOCK_COUNT_KEYS))
    n_head, n_kv_head = hparams["num_attention_heads"], hparams["num_key_value_heads"]
    named: list[tuple[str, torch.Tensor]] = []  # (GGUF name, tensor)
    if arch == gguf.MODEL_ARCH.LLAMA and (
            factors := llama3_rope_factors(hparams, rope_parameters(hparams))) is not None:
        named.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors))
    if arch == gguf.MODEL_ARCH.PHI3:
        named += phi3_rope_factors(hparams)
    if arch == gguf.MODEL_ARCH.GEMMA4:
        named.append((gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                      gemma4_rope_freqs(hparams)))
    merger = ExpertMerger(hparams, arch)
    out: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
    source = _hf_tensors(model_dir)
    if arch == gguf.MODEL_ARCH.GPT_OSS:  # its MXFP4 experts first, raw; then its renames
        out = gguf_gpt_oss.mxfp4_experts(_hf_tensors(model_dir), tensor_map)
        source = gguf_gpt_oss.modified_tensors(source)
    if arch in gguf_qwen3_next.QWEN3_NEXT_ARCHS.values():
        source = gguf_qwen3_next.qwen3_next_tensors(source, hparams, arch)
    for name, data_torch in source:
        if name.endswith((".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")):
            continue
        if arch in _GEMMA and name == "lm_head.weight":
            continue  # Gemma2Model.filter_tensors: llama.cpp ties the head
        if arch in _GEMMA and name.endswith("norm.weight"):
            data_torch = data_torch + 1  # Gemma*Model.modify_tensors: GemmaRMSNorm's 1 + w
        if arch in _GEMMA3_FAMILY and "embed_tokens.weight" in name:
            data_torch = data_torch[:_real_vocab_size(model_dir)]  # OOV rows dropped
        if data_torch.dtype not in (torch.float16, torch.float32):
            data_torch = data_torch.to(torch.float32)
        if undo_permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            data_torch = permute(data_torch, n_head, n_head)
        if undo_permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            data_torch = permute(data_torch, n_head, n_kv_head)
        if arch == gguf.MODEL_ARCH.GEMMA4 and name.endswith("layer_scalar"):
            name += ".weight"  # Gemma4Model.filter_tensors
        merged = merger.add(name, data_torch)
        if merged is None:
            continue  # an expert's tensor: written with its layer's others, merged
        for merged_name, merged_data in merged:
            new_name = tensor_map.get_name(key=merged_name, try_suffixes=(".weight", ".bias"))
            if new_name is None:
                raise ValueError(f"Can not map tensor {merged_name!r}")
            named.append((new_name, merged_data))
    for new_name, data_torch in named:
        data = data_torch.numpy()
        qtype = _tensor_type(new_name, data.ndim, types)
        try:
            qdata = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:  # row length not a multiple of the block size: converter's fallback
            qtype = gguf.GGMLQuantizationType.F16
            qdata = gguf.quants.quantize(data, qtype)
        out.append((new_name, qdata, qtype))
    merger.check_done()
    return out


class ExpertMerger:
    """``Qwen2MoeModel`` / ``OlmoeModel`` / ``LlamaModel.modify_tensors``' expert merging: a
    layer's per-expert tensors are held until all 3 * E arrived, then written as one 3-D tensor
    per projection, in the converter's order and names."""

    _PATTERN = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\."
                          r"(\w+)\.weight$")

    def __init__(self, hparams: dict[str, Any], arch: gguf.MODEL_ARCH) -> None:
        self.num_experts = find_hparam(hparams, ["num_local_experts", "num_experts"]) or 0
        mixtral = arch == gguf.MODEL_ARCH.LLAMA
        self.order = ("w1", "w2", "w3") if mixtral else ("down_proj", "gate_proj", "up_proj")
        self.merged_name = ("layers.{bid}.feed_forward.experts.{w}.weight" if mixtral
                            else "model.layers.{bid}.mlp.experts.{w}.weight")
        self.pending: dict[int, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, name: str, data: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[(name, tensor)] to write for this checkpoint tensor, or None (held)."""
        match = self._PATTERN.match(name)
        if match is None or not self.num_experts:
            return [(name, data)]
        bid = int(match.group(1))
        layer = self.pending.setdefault(bid, {})
        layer[(int(match.group(3)), match.group(4))] = data
        if len(layer) < 3 * self.num_experts:
            return None
        del self.pending[bid]
        return [(self.merged_name.format(bid=bid, w=w),
                 torch.stack([layer[(x, w)] for x in range(self.num_experts)]))
                for w in self.order]

    def check_done(self) -> None:
        if self.pending:
            raise ValueError(f"Unprocessed experts in layers {sorted(self.pending)}")


def _real_vocab_size(model_dir: Path) -> int:
    """Gemma3Model.modify_tensors' count: tokenizer.json's vocab plus its added tokens."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])


def _shard_starts(num_tensors: int, num_splits: int) -> list[int]:
    """Tensor indices that open a new file: contiguous, balanced runs, every file non-empty."""
    if not 1 <= num_splits <= num_tensors:
        raise ValueError(f"num_splits must be in 1..{num_tensors} (the tensor count), "
                         f"got {num_splits}")
    return [i * num_tensors // num_splits for i in range(1, num_splits)]


def write_gguf(model_dir: str | Path, out_path: str | Path, tensor_type: str = "F16",
               num_splits: int = 1, tensor_types: dict[str, str] | None = None) -> list[Path]:
    """Write the HF model in model_dir as GGUF the way convert_hf_to_gguf.py does; returns the
    file(s) written.

    ``tensor_type`` is one of :data:`WRITABLE_TYPES`, and so is each value of ``tensor_types``:
    the type of the tensors whose GGUF name ends with its key (a mixed file, as a Q4_K_M is).
    With ``num_splits > 1`` the files are ``<stem>-0000i-of-0000N.gguf`` next to ``out_path``
    (gguf-split's names), metadata in the first, ``split.*`` counts in each.
    """
    types = {**(tensor_types or {}), "": tensor_type}  # name ending -> type; "" matches all
    if bad := [t for t in types.values() if t not in _GGML_TYPE_OF]:
        raise ValueError(f"tensor_type {bad[0]!r} not writable; one of {WRITABLE_TYPES}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    hparams = load_hparams(model_dir)
    hf_arch = (hparams.get("architectures") or [None])[0]
    if hf_arch not in _GGUF_ARCH_OF:
        raise ValueError(f"architecture {hf_arch!r} not supported; one of {list(_GGUF_ARCH_OF)}")
    arch, undo_permute = _GGUF_ARCH_OF[hf_arch]
    ftype = _GGML_TYPE_OF[tensor_type][1]
    mxfp4 = (hparams.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    if mxfp4 and tensor_type in ("F32", "F16", "BF16"):  # ModelBase.prepare_metadata's
        ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    converted = _convert_tensors(model_dir, hparams, arch, undo_permute,
                                 {end: _GGML_TYPE_OF[t][0] for end, t in types.items()})
    starts = set(_shard_starts(len(converted), num_splits))  # before writing anything
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    for i, (name, data, dtype) in enumerate(converted):
        if i in starts:
            writer.tensors.append({})  # a new file; GGUFWriter's own split does the same
        writer.add_tensor(name, data, raw_dtype=dtype)
    # ModelBase.prepare_metadata, then TextModel.prepare_metadata's set_vocab.
    total, shared, expert, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, model_dir, None, total)
    if metadata.name is None:
        metadata.name = model_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, expert_count)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)
    add_hparams(writer, hparams, arch, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if arch in LLAMA_MODEL_ARCHS:  # LlamaModel.set_vocab, before _set_vocab_gpt2
        tok_config = model_dir / "tokenizer_config.json"
        config = json.loads(tok_config.read_text(encoding="utf-8")) if tok_config.is_file() else {}
        if (add_prefix_space := config.get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(add_prefix_space)
    add_vocab(writer, model_dir, hparams)
    # Written in a scratch dir and renamed into place: a reader never sees a partial file.
    out_path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.tmp-", dir=out_path.parent))
    try:
        writer.write_header_to_file(path=scratch / out_path.name)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        files = writer.format_shard_names(out_path)
        for f in files:
            os.replace(scratch / f.name, f)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return files
