"""mrv2.testing.gguf_gpt_oss: llama.cpp's GptOssModel as ported. Its MXFP4 repacking gives the
bytes mrv2's own reading of the checkpoint layout gives (models/mxfp4.as_gguf_blocks: two
implementations, one result), its renames and splits, and a written MXFP4 file's keys, types
and shapes. (The port's files were compared byte for byte with the converter's own output on
the tiny checkpoints, F32 / F16 / BF16, float and MXFP4; the files' tokens are
tests/models/test_gpt_oss.py's.)"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from mrv2.models.mxfp4 import as_gguf_blocks
from mrv2.testing.gguf_gpt_oss import modified_tensors, repack_mxfp4
from mrv2.testing.gguf_writer import write_gguf
from tests.models.mxfp4_helpers import mxfp4_checkpoints
from tests.models.test_gpt_oss import TINY_GPT_OSS_7


def test_repacked_blocks_are_mrv2s_reading_of_the_layout():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(100, 140, (2, 6, 3), generator=gen).to(torch.uint8)
    assert np.array_equal(repack_mxfp4(blocks, scales), as_gguf_blocks(blocks, scales))


def test_float_experts_are_transposed_and_split_and_sinks_renamed():
    e, h, i = 2, 4, 3
    gate_up = torch.arange(e * h * 2 * i, dtype=torch.float32).reshape(e, h, 2 * i)
    down, bias = torch.randn(e, i, h), torch.arange(e * 2 * i, dtype=torch.float32).reshape(e, -1)
    out = dict(modified_tensors([
        ("model.layers.0.mlp.experts.down_proj", down),
        ("model.layers.0.mlp.experts.down_proj_blocks", torch.zeros(1)),
        ("model.layers.0.mlp.experts.gate_up_proj", gate_up),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", bias),
        ("model.layers.0.mlp.experts.gate_up_proj_scales", torch.zeros(1)),
        ("model.layers.0.self_attn.sinks", torch.zeros(4))]))
    prefix = "model.layers.0.mlp.experts"
    assert list(out) == [f"{prefix}.down_proj.weight", f"{prefix}.gate_proj.weight",
                         f"{prefix}.up_proj.weight", f"{prefix}.gate_proj.bias",
                         f"{prefix}.up_proj.bias", "model.layers.0.self_attn.sinks.weight"]
    assert torch.equal(out[f"{prefix}.down_proj.weight"], down.transpose(1, 2))
    assert torch.equal(out[f"{prefix}.gate_proj.weight"], gate_up.transpose(1, 2)[:, 0::2])
    assert torch.equal(out[f"{prefix}.up_proj.weight"], gate_up.transpose(1, 2)[:, 1::2])
    assert torch.equal(out[f"{prefix}.up_proj.bias"], bias[:, 1::2])


def test_mxfp4_file_keys_types_and_shapes(tiny_model_factory, tmp_path):
    quantized, _ = mxfp4_checkpoints(tiny_model_factory("gpt_oss", **TINY_GPT_OSS_7), tmp_path)
    (path,) = write_gguf(quantized, tmp_path / "out" / "tiny.gguf", "F16")
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.architecture"] == "gpt-oss"
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    assert fields["gpt-oss.attention.sliding_window"] == 6
    assert fields["gpt-oss.expert_feed_forward_length"] == 128
    assert fields["gpt-oss.rope.scaling.type"] == "yarn"
    types = {t.name: (t.tensor_type.name, [int(n) for n in t.shape]) for t in reader.tensors}
    assert reader.tensors[0].name == "blk.0.ffn_down_exps.weight"  # written first, raw
    assert types["blk.0.ffn_gate_exps.weight"] == ("MXFP4", [64, 128, 4])
    assert types["blk.0.ffn_down_exps.weight"] == ("MXFP4", [128, 64, 4])
    assert types["blk.0.ffn_up_exps.bias"] == ("F32", [128, 4])
    assert types["blk.0.ffn_gate_inp.weight"] == ("F32", [64, 4])
    assert types["blk.0.attn_sinks.weight"] == ("F32", [4])
    assert types["blk.0.attn_q.weight"] == ("F16", [64, 64])
