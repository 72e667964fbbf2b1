"""Batch-invariant mode: on the float32, bfloat16 and GGUF-blocks paths a request's token ids
and logprobs are bit-identical alone, among 1, 3, 7 and 31 other requests of other lengths at
random places and last, after a prefix-cache hit, with a small chunked-prefill budget and at
1 thread; the default mode differs on the same cases (so the comparison can fail). Each engine
runs in a child process (tests/batch_invariant_helpers.py): the mode is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mrv2 import batch_invariant
from mrv2.engine.arg_utils import EngineArgs


def _cases(tmp_path: Path, model: Path, dtype: str, quantization: str | None,
           invariant: bool) -> dict:
    out = tmp_path / f"cases-{int(invariant)}.json"
    subprocess.run([sys.executable, str(Path(__file__).with_name("batch_invariant_helpers.py")),
                    str(out), str(model), dtype, quantization or "none", str(int(invariant))],
                   check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", ["float32", "bfloat16", "gguf"])
def test_a_requests_answer_does_not_depend_on_its_batch(path, tiny_llama, tiny_gguf_factory,
                                                        tmp_path):
    model = tiny_gguf_factory("llama", "Q4_1") if path == "gguf" else tiny_llama
    dtype = "float32" if path == "gguf" else path
    quantization = "gguf" if path == "gguf" else None
    cases = _cases(tmp_path, model, dtype, quantization, invariant=True)
    alone = cases.pop("alone")
    assert len(alone["token_ids"]) == 6
    for name, case in cases.items():
        assert case == alone, name
    if path == "float32":  # the default mode's sums follow the batch: the check can fail
        default = _cases(tmp_path, model, dtype, quantization, invariant=False)
        alone = default.pop("alone")
        assert any(case["logprobs"] != alone["logprobs"] for case in default.values())


def test_the_demos_chats_alone_and_together(tmp_path):
    """The built-in SmolLM2 (a 49152-token vocabulary) answers the demo's four chats with the
    same bits alone and in one batch, greedy and with seeded sampling through every filter
    (bfloat16: the default dtype on a CPU with native bf16; the float32 path's batch
    invariance is the tiny models' test above, its vocabulary-wide ops the same kernels)."""
    answers = _cases(tmp_path, Path("demo"), "bfloat16", None, invariant=True)
    for name in ("greedy", "sampled"):
        assert answers[name]["together"] == answers[name]["alone"], name
    assert answers["sampled"]["alone"] != answers["greedy"]["alone"]


def test_the_mode_reaches_the_model_config(tiny_llama, monkeypatch):
    def config(**kwargs):
        return EngineArgs(model=str(tiny_llama), device="cpu",
                          **kwargs).create_engine_config().model_config

    monkeypatch.delenv("MRV2_BATCH_INVARIANT", raising=False)
    assert config().batch_invariant is False
    assert config(batch_invariant=True).batch_invariant is True
    monkeypatch.setenv("MRV2_BATCH_INVARIANT", "1")
    assert config().batch_invariant is True
    assert config(batch_invariant=False).batch_invariant is False
    cuda = EngineArgs(model=str(tiny_llama), device="cuda", batch_invariant=True)
    assert cuda.create_engine_config().model_config.batch_invariant is True


def test_set_active_is_what_the_kernels_read():
    from mrv2.attention.decode_numba import work_split
    from mrv2.models.layers.linear_plan import LinearKernel, plan_for

    try:
        batch_invariant.set_active(True)
        assert batch_invariant.active()
        assert work_split(1, 2, 8, 1 << 30) == (1, 1)
        plan = plan_for("u4", False)
        assert plan.kernel_for(1) is plan.kernel_for(10 ** 6)
        assert plan.kernel_for(1) is not LinearKernel.BLOCK_TILES
        assert plan_for("bf16", True).kernel_for(500) is LinearKernel.HALF_GEMV
    finally:
        batch_invariant.set_active(False)
    assert work_split(1, 2, 8, 1 << 30) != (1, 1)
    assert plan_for("u4", False).kernel_for(500) is LinearKernel.BLOCK_TILES
