"""The built-in SmolLM2-135M-Instruct GGUF (Q4_1) for the GGUF benchmarks: the e2e workload of
its shapes, transformers' float32 load of the same file, and its safetensors twin.

The twin is the GGUF as transformers dequantizes it (float32), written with `save_pretrained`
(safetensors, config without the GGUF quantization_config, the tokenizer transformers reads off
the file) under mrv2.testing's cache dir, keyed by the GGUF file's name and size. It is built
once (a minute or so: transformers' GGUF load and tokenizer conversion are slow) and published
atomically, so concurrent first runs are safe. mrv2 loading the twin and the GGUF builds the
same float32 model from the same file, one through the safetensors path, one dequantizing.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import torch

from e2e_workload import Workload, set_threads

TWIN_FORMAT = 1  # bump when the twin's files change for the same GGUF
OUTPUT_LEN = 128
INPUT_LEN = 128

# SmolLM2-135M's shapes (llama: 30 layers, hidden 576, 9 heads of 64, 3 KV heads, tied head).
SMOLLM2 = Workload("SmolLM2-135M", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                   intermediate_size=1536, vocab_size=49152, num_prompts=1, input_len=INPUT_LEN,
                   output_len=OUTPUT_LEN)


def smollm2_workload(batch: int, reduced: bool = False) -> Workload:
    """`batch` prompts of INPUT_LEN random ids, OUTPUT_LEN tokens each; `reduced` (CI) keeps
    the real model (a GGUF has no smaller variant) and shrinks the batch and token counts."""
    w = replace(SMOLLM2, name=f"SmolLM2-b{batch}", num_prompts=batch)
    if reduced:
        w = replace(w, name=w.name + "-reduced", num_prompts=min(batch, 2), input_len=16,
                    output_len=4)
    return w


def max_model_len(w: Workload) -> int:
    """As e2e_workload.Mrv2Runner sizes it."""
    return w.input_len + w.output_len + 16


def gguf_path() -> Path:
    from mrv2.models.builtin import builtin_model_path

    return builtin_model_path()


def load_hf_gguf(path: Path | None = None) -> torch.nn.Module:
    """transformers' float32 model of the GGUF file (dequantized at load), eval mode."""
    from transformers import AutoModelForCausalLM

    path = path or gguf_path()
    set_threads()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def load_hf_dir(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    set_threads()
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def twin_dir(path: Path | None = None) -> Path:
    from mrv2.testing import cache_dir

    path = path or gguf_path()
    return (cache_dir() / "models" /
            f"gguf-twin-v{TWIN_FORMAT}-{path.stem}-{path.stat().st_size}")


def safetensors_twin(path: Path | None = None,
                     hf_model: torch.nn.Module | None = None) -> Path:
    """The GGUF's safetensors twin directory (built on first use; see the module docstring).
    `hf_model`: the GGUF already loaded by `load_hf_gguf`, to skip loading it again."""
    from transformers import AutoTokenizer

    from mrv2.testing.tokenizer import make_temp_dir, publish_dir

    path = path or gguf_path()
    final = twin_dir(path)
    if (final / "config.json").is_file():
        return final
    model = hf_model if hf_model is not None else load_hf_gguf(path)
    tmp = make_temp_dir(final)
    try:
        # Without the `kernels` package transformers dequantizes every weight (plain float32
        # nn.Linear), but keeps its GGUF quantizer, which refuses to save, and the GGUF marker
        # in the config: hide both so the twin is a plain float32 checkpoint.
        packed = [n for n, m in model.named_modules() if type(m).__name__.startswith("Gguf")]
        assert not packed, f"weights left packed by transformers: {packed[:3]}"
        quantizer = getattr(model, "hf_quantizer", None)
        quant_config = getattr(model.config, "quantization_config", None)
        model.hf_quantizer = None
        if quant_config is not None:
            del model.config.quantization_config
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            model.hf_quantizer = quantizer
            if quant_config is not None:
                model.config.quantization_config = quant_config
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(
            str(tmp))
        publish_dir(tmp, final)  # losing the race is fine: the winner's files are the same
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
