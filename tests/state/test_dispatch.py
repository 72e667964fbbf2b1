"""Kernel dispatch: CPU tensors use numba, CUDA tensors Triton; Triton is imported lazily, and
the test switch runs Triton interpreted (TRITON_INTERPRET=1) on CPU tensors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mrv2 import platform as dispatch

CPU = torch.device("cpu")


def test_cpu_tensors_use_cpu_kernels_unless_forced() -> None:
    assert dispatch.kernel_impl(CPU) == dispatch.CPU
    with dispatch.forced_impl(dispatch.TRITON):
        assert dispatch.kernel_impl(CPU) == dispatch.TRITON
        with dispatch.forced_impl(dispatch.CPU):
            assert dispatch.kernel_impl(CPU) == dispatch.CPU
        assert dispatch.kernel_impl(CPU) == dispatch.TRITON
    assert dispatch.kernel_impl(CPU) == dispatch.CPU
    with pytest.raises(ValueError):
        with dispatch.forced_impl("cuda"):
            pass
    with pytest.raises(RuntimeError):
        dispatch.kernel_impl(torch.device("meta"))


def test_cuda_tensors_always_use_triton() -> None:
    with dispatch.forced_impl(dispatch.CPU):
        assert dispatch.kernel_impl(torch.device("cuda")) == dispatch.TRITON


def test_triton_interpreter_jits_interpreted_kernels_after_a_compiled_import() -> None:
    """Triton 3.x reads TRITON_INTERPRET when a function is jitted, not when triton is
    imported: kernels are jitted once per mode, so an earlier `import triton` does not matter,
    and the environment is restored afterwards."""
    import os

    import triton  # noqa: F401  (imported outside the interpreter first)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from mrv2.state import staged_triton

    before = os.environ.get("TRITON_INTERPRET")
    with dispatch.triton_interpreter():
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert dispatch.kernel_impl(CPU) == dispatch.TRITON
        kernel = dispatch.triton_kernel(staged_triton._apply_runs_kernel)
        assert isinstance(kernel, InterpretedFunction)
        assert dispatch.triton_kernel(staged_triton._apply_runs_kernel) is kernel
    assert os.environ.get("TRITON_INTERPRET") == before
    assert dispatch.kernel_impl(CPU) == dispatch.CPU
    if before != "1":
        compiled = dispatch.triton_kernel(staged_triton._apply_runs_kernel)
        assert isinstance(compiled, JITFunction)


def test_cpu_path_works_without_triton() -> None:
    """A CPU-only machine whose triton cannot be imported: every state and input op runs."""
    script = textwrap.dedent("""
        import sys

        class NoTriton:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton is broken here")

        sys.meta_path.insert(0, NoTriton())
        import numpy as np
        import torch
        from mrv2.inputs.buffers import InputBuffers
        from mrv2.inputs.prepare import prepare_inputs
        from mrv2 import platform as dispatch
        from mrv2.state.block_table import BlockTables
        from mrv2.state.requests import RequestState

        cpu = torch.device("cpu")
        state, tables = RequestState(2, 8, cpu), BlockTables(2, 2, 4, cpu)
        buffers = InputBuffers(8, 2, 2, cpu)
        slot = state.add("a", 3, [5, 6, 7], 0)
        tables.append_block_ids(slot, [1])
        state.apply_staged_writes()
        tables.apply_staged_writes()
        batch = prepare_inputs(["a"], np.array([slot]), np.array([3]), state, tables, buffers)
        state.post_update(batch.idx_mapping, batch.num_scheduled, torch.tensor([9]))
        assert batch.input_ids.tolist() == [5, 6, 7]
        assert state.token_ids.tensor[slot, :4].tolist() == [5, 6, 7, 9]
        assert not dispatch.triton_available()
        assert "triton" not in sys.modules
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
