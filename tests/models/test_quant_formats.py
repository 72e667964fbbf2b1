"""The formats table: every row's block geometry is ggml's, its layout one the kernels take,
unknown types are refused by name, and a row registered in the table alone is what the
loader, the GEMV and the fused decode stack compute with. The values each row's decoder gives
are checked against gguf.quants in test_gguf_blocks.py and test_quantized.py (which iterate
over FORMATS)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.models.layers import gguf_blocks
from mrv2.models.layers.quant_formats import FORMATS, QuantFormat, packs, quant_format
from mrv2.models.layers.quantized import quantized_linear
from tests.models.quantized_helpers import dequantized


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rows_match_ggmls_block_sizes(name):
    fmt = FORMATS[name]
    assert fmt.name == name
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (fmt.block_size,
                                                                       fmt.block_bytes)
    assert fmt.layout in ("u4", "i8", "f16", "bf16")
    assert fmt.is_16bit == (fmt.layout in ("f16", "bf16"))


def test_unknown_types_are_refused_by_name():
    assert not packs("IQ2_XXS") and packs("Q4_K")
    with pytest.raises(ValueError, match="'IQ2_XXS'.*accepted"):
        quant_format("IQ2_XXS")


def _coarse_q8_0(blocks: np.ndarray):
    """A made-up format on Q8_0's bytes: its values with the lowest bit cleared."""
    values, scales, mins = gguf_blocks.q8_0(blocks)
    return values & np.int8(-2), scales, mins


COARSE = QuantFormat("Q8_0", "i8", 32, 34, _coarse_q8_0)


@pytest.mark.usefixtures("float_activations")
def test_a_row_registered_in_the_table_reaches_load_gemv_and_the_fused_stack(
        tiny_gguf_factory, monkeypatch):
    """One table row replaced (a decoder no kernel knows of): the loader packs the file's
    tensors with it, the GEMV multiplies by its values, and the fused decode stack gives the
    module path's tokens and logprobs on them."""
    path = str(tiny_gguf_factory("llama", "Q8_0"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompt = [{"prompt_token_ids": list(range(5, 25))}]

    def run(fused: bool):
        llm = LLM(path, max_model_len=64, quantization="gguf", enable_prefix_caching=False)
        worker = llm.llm_engine.engine_core.executor.worker
        assert worker.runner.fused_decode is not None
        if not fused:
            worker.runner.fused_decode = None
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        down = worker.model.model.layers[0].mlp.down_proj
        llm.shutdown()
        return out, down

    real, _ = run(True)
    monkeypatch.setitem(FORMATS, "Q8_0", COARSE)
    stack, down = run(True)
    module_path, _ = run(False)
    # Loaded with the registered decoder: every value even.
    weight = down.packed
    assert weight.gguf_type == "Q8_0"
    values = dequantized(weight) / weight.scales.view(torch.float16).float().repeat_interleave(
        32, dim=1)
    assert torch.all(torch.round(values) % 2 == 0)
    x = torch.randn(3, weight.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(quantized_linear(x, weight), x @ dequantized(weight).T,
                               rtol=1e-5, atol=1e-5)
    assert stack.token_ids == module_path.token_ids
    assert stack.logprobs == module_path.logprobs
    assert stack.logprobs != real.logprobs  # the registered row was in effect
