"""utils/kernel_flags: no kernel reassociates its sums, so kernels compiled in the process and
kernels loaded from numba's on-disk cache give the same bits (issue 47: the demo's first run
after an install and its later runs printed different text)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mrv2.utils.kernel_flags import FASTMATH, IR_FLAGS

PACKAGE = Path(__file__).resolve().parents[2] / "mrv2"


def test_the_flags_leave_sums_in_source_order():
    assert not {"reassoc", "arcp", "afn", "fast"} & set(FASTMATH)
    assert set(IR_FLAGS) == FASTMATH


def test_no_kernel_compiles_with_numbas_fast_flags():
    """`fastmath=True` (or "fast" on an IR instruction) anywhere would bring reassociation
    back: every kernel takes kernel_flags' sets."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for pattern in (r"fastmath\s*=\s*True", r"[\"']fastmath[\"']\s*:\s*True",
                        r"flags\s*=\s*\(\s*[\"']fast[\"']"):
            offenders += [f"{path.relative_to(PACKAGE)}: {m.group(0)}"
                          for m in re.finditer(pattern, text)]
    assert offenders == []


def test_row_sums_are_exact_on_exact_inputs_and_in_a_fixed_order():
    from numba import njit

    from mrv2.models.layers.vector_ir import row_sum, row_sum_squares

    @njit
    def sums(a, row, n):
        return row_sum(a, row, n), row_sum_squares(a, row, n)

    a = np.arange(3 * 77, dtype=np.float32).reshape(3, 77) / 4  # sums exact in float32
    for n in (0, 1, 7, 8, 31, 32, 33, 77):
        total, squares = sums(a, 1, n)
        assert total == a[1, :n].astype(np.float64).sum()
        assert squares == (a[1, :n].astype(np.float64) ** 2).sum()
    # Four 8-wide accumulators, then the rest: the float32 result of exactly that order.
    x = np.random.default_rng(0).standard_normal((1, 45)).astype(np.float32) * 1e3
    lanes = np.zeros((4, 8), np.float32)
    for unit in range(5):
        lanes[unit % 4 if unit < 4 else 0] += x[0, unit * 8:unit * 8 + 8]
    v = lanes[0] + lanes[1] + lanes[2] + lanes[3]
    while v.shape[0] > 1:
        v = v[:v.shape[0] // 2] + v[v.shape[0] // 2:]
    rest = np.float32(0.0)
    for value in x[0, 40:]:
        rest += value
    assert sums(x, 0, 45)[0] == v[0] + rest


def _answers(tmp_path: Path, cache: Path, name: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), MRV2_FIT_THREADS_TO_FREE_CORES="0")
    subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_flags_helpers.py")),
                    str(out), "bfloat16", "none", "16"], env=env, check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_kernels_compiled_in_the_process_and_loaded_from_the_cache_answer_alike(tmp_path):
    """SmolLM2's chat answers (bfloat16 weights, the default dtype where the CPU computes it)
    with every kernel compiled into an empty cache, then with every kernel loaded from it:
    the same token ids and bit-identical logprobs (before kernel_flags, 20 of 79 steps'
    logprobs differed)."""
    cache = tmp_path / "numba"
    fresh = _answers(tmp_path, cache, "fresh")
    assert any(cache.rglob("*.nbc"))  # the first run filled the cache
    warm = _answers(tmp_path, cache, "warm")
    assert [a["token_ids"] for a in fresh] == [a["token_ids"] for a in warm]
    assert [a["logprobs"] for a in fresh] == [a["logprobs"] for a in warm]
