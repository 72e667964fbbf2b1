"""transformers' reading of a GGUF file, kept as a float32 safetensors checkpoint (its "twin").

transformers' GGUF loader is the reference for mrv2's (tests/entrypoints/test_llm_gguf.py,
bench/test_gguf.py), but it is slow (tens of seconds for the built-in model: its metadata parse
and tokenizer conversion). The twin is what it loads, written once with `save_pretrained`
(safetensors, the config without the GGUF quantization_config, the tokenizer transformers builds
from the file) under mrv2's cache dir, keyed by the file's name and size, and published
atomically, so concurrent first runs are safe. Loading the twin gives transformers' model of the
file again, bit for bit, in a fraction of a second.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TWIN_FORMAT = 1  # bump when the twin's files change for the same GGUF


def load_hf_gguf(path: Path) -> torch.nn.Module:
    """transformers' float32 model of the GGUF file (dequantized at load), eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def twin_dir(path: Path) -> Path:
    from mrv2.utils.disk_cache import cache_root

    return (cache_root() / "models" /
            f"gguf-twin-v{TWIN_FORMAT}-{path.stem}-{path.stat().st_size}")


def safetensors_twin(path: Path, hf_model: torch.nn.Module | None = None) -> Path:
    """The GGUF's safetensors twin directory (built on first use; see the module docstring).
    `hf_model`: the GGUF already loaded by `load_hf_gguf`, to skip loading it again."""
    from transformers import AutoTokenizer

    from mrv2.testing.tokenizer import make_temp_dir, publish_dir

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
