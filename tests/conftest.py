"""Shared fixtures: tiny random-weight HF models, built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# OpenMP threads (torch's and numba's) sleep while they wait instead of spinning. Two pytest
# workers on two cores, each with two threads, and the engine processes they start: a spinning
# waiter takes the core another process needs, so every parallel region's barrier waits out a
# scheduler slice. The whole suite with every cache warm on 2-core Zen 3: 14:27 spinning, 9:29
# sleeping. libgomp reads it once, when torch loads it: so before torch is imported.
assert "torch" not in sys.modules, "OMP_WAIT_POLICY must be set before torch loads libgomp"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests measure correctness, not speed: keep them reproducible and off extra threads.
torch.manual_seed(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A fixed kernel thread count: fitted to the free cores (mrv2/utils/free_cores.py), it would
# follow the other pytest worker's load, and with it the decode attention's work split.
os.environ.setdefault("MRV2_FIT_THREADS_TO_FREE_CORES", "0")
# dtype="auto" on the CPU follows the machine (bfloat16 where it has matrix units for it);
# the suite's references are float32 models, so it pins float32 (tests of the choice unset it).
os.environ.setdefault("MRV2_CPU_AUTO_DTYPE", "float32")
# Weights stay on the pages they were loaded on: collapsing them onto huge pages costs each
# engine start about a second a gigabyte (utils/huge_pages.py; its tests and the worker's
# turn it on where they check it).
os.environ.setdefault("MRV2_HUGE_PAGE_WEIGHTS", "0")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns build(arch="llama", **kwargs) -> model dir; identical requests share a dir."""
    from mrv2.testing import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    built: dict[tuple, Path] = {}

    def build(arch: str = "llama", **kwargs) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in built:
            built[key] = Path(make_tiny_model(root / f"{arch}-{len(built)}", arch=arch, **kwargs))
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_gguf_factory(tiny_model_factory, tmp_path_factory):
    """Returns build(arch="llama", tensor_type="F16", num_splits=1, tensor_types=None,
    **model_kwargs) -> the GGUF file (the first of a split) written from the tiny model as
    llama.cpp's converter would (`tensor_types`: per-name types, gguf_writer.write_gguf)."""
    from mrv2.testing.gguf_writer import write_gguf

    root = tmp_path_factory.mktemp("gguf")
    built: dict[tuple, Path] = {}

    def build(arch: str = "llama", tensor_type: str = "F16", num_splits: int = 1,
              tensor_types: dict[str, str] | None = None, **kwargs) -> Path:
        key = (arch, tensor_type, num_splits, repr(sorted((tensor_types or {}).items())),
               tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in built:
            model_dir = tiny_model_factory(arch, **kwargs)
            out = root / f"{arch}-{len(built)}" / f"tiny-{tensor_type}.gguf"
            out.parent.mkdir()
            built[key] = write_gguf(model_dir, out, tensor_type, num_splits=num_splits,
                                    tensor_types=tensor_types)[0]
        return built[key]

    return build


@pytest.fixture
def float_activations(monkeypatch):
    """GEMVs on quantized GGUF blocks take float32 x (their result is x @ w.T up to float32
    summation order) instead of x rounded to int16 or int8, and 16-bit weights never run on
    the CPU's bfloat16 matrix units (which round x); set before an LLM is built (the decode
    weights' plans read it when they are made)."""
    from mrv2.models.layers import linear_plan, quantized, quantized_numba
    monkeypatch.setattr(linear_plan, "GEMV_X_FORMAT", quantized_numba.X_FLOAT32)
    monkeypatch.setattr(quantized, "computes_natively", lambda dtype: False)


@pytest.fixture
def row_invariant_interpreter_dot(monkeypatch):
    """The Triton interpreter's tl.dot with each output summed over k in one order, wherever
    its row sits in the tile. The interpreter hands tl.dot to numpy's BLAS, whose kernels may
    round a row by its place in the tile (OpenBLAS's AVX2 sgemm on Zen 3 does); a GPU's tl.dot
    gives a row one result wherever it sits, the property batch-invariance tests check."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and a.dtype.primitive_bitwidth >= 16):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("mk,kn->mn", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    original = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
