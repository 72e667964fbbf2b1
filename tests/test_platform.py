"""Device choice (MRV2_DEVICE override, CUDA availability, caching, KV cache budget) and kernel
choice: CPU tensors use the CPU twins, CUDA tensors Triton; Triton is imported lazily, and the
test override runs Triton interpreted (TRITON_INTERPRET=1) on CPU tensors; the CPU feature
helpers answer from cpu_caps."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mrv2 import cpu_caps, platform


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("MRV2_DEVICE", raising=False)
    platform.device_type.cache_clear()
    yield
    platform.device_type.cache_clear()


def test_cpu_when_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.device_type() == "cpu"
    assert not platform.is_cuda()
    assert platform.default_device() == torch.device("cpu")


def test_cuda_when_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.device_type() == "cuda"
    assert platform.is_cuda()
    assert platform.default_device() == torch.device("cuda")


@pytest.mark.parametrize("forced, available", [("cpu", True), ("cuda", False)])
def test_env_override_wins(monkeypatch: pytest.MonkeyPatch, forced: str,
                           available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setenv("MRV2_DEVICE", forced)
    assert platform.device_type() == forced


def test_empty_env_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MRV2_DEVICE", "")
    assert platform.device_type() == "cpu"


@pytest.mark.parametrize("value", ["gpu", "CUDA", "mps"])
def test_invalid_env_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MRV2_DEVICE", value)
    with pytest.raises(ValueError, match="MRV2_DEVICE"):
        platform.device_type()


def test_choice_is_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def available() -> bool:
        calls.append(1)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", available)
    assert platform.device_type() == "cpu"
    monkeypatch.setenv("MRV2_DEVICE", "cuda")
    assert platform.device_type() == "cpu"  # cached
    assert platform.default_device().type == "cpu"
    assert len(calls) == 1
    platform.device_type.cache_clear()
    assert platform.device_type() == "cuda"


def test_cpu_kv_cache_default() -> None:
    assert platform.default_kv_cache_bytes(torch.device("cpu")) == 4 * (1 << 30)
    assert platform.DEFAULT_CPU_KV_CACHE_GB == 4.0


def test_gpu_kv_cache_default_is_the_utilization_share_left_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def mem_get_info(device):
        seen.append(device)
        return 10_000, 80_000

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    device = torch.device("cuda", 0)
    # 70,000 of 80,000 in use: 90% of 80,000 leaves 2,000; 95% leaves 6,000.
    assert platform.default_kv_cache_bytes(device) == 2_000
    assert platform.default_kv_cache_bytes(device, 0.95) == 6_000
    assert seen == [device, device]


CPU = torch.device("cpu")


def test_cpu_tensors_use_cpu_kernels_unless_forced() -> None:
    assert platform.kernel_impl(CPU) == platform.CPU
    with platform.forced_impl(platform.TRITON):
        assert platform.kernel_impl(CPU) == platform.TRITON
        with platform.forced_impl(platform.CPU):
            assert platform.kernel_impl(CPU) == platform.CPU
        assert platform.kernel_impl(CPU) == platform.TRITON
    assert platform.kernel_impl(CPU) == platform.CPU
    with pytest.raises(ValueError):
        with platform.forced_impl("cuda"):
            pass
    with pytest.raises(RuntimeError):
        platform.kernel_impl(torch.device("meta"))


def test_cuda_tensors_always_use_triton() -> None:
    with platform.forced_impl(platform.CPU):
        assert platform.kernel_impl(torch.device("cuda")) == platform.TRITON


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
    with platform.triton_interpreter():
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert platform.kernel_impl(CPU) == platform.TRITON
        kernel = platform.triton_kernel(staged_triton._apply_runs_kernel)
        assert isinstance(kernel, InterpretedFunction)
        assert platform.triton_kernel(staged_triton._apply_runs_kernel) is kernel
    assert os.environ.get("TRITON_INTERPRET") == before
    assert platform.kernel_impl(CPU) == platform.CPU
    if before != "1":
        compiled = platform.triton_kernel(staged_triton._apply_runs_kernel)
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
        from mrv2 import cpu_caps, platform
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
        assert not platform.triton_available()
        assert "triton" not in sys.modules
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("caps, bf16, fp16, tiles", [
    (cpu_caps.CpuCaps(avx2=True), False, False, False),  # AVX2 only (Zen 3)
    (cpu_caps.CpuCaps(avx512f=True, avx512_bf16=True), True, False, False),  # Zen 4
    (cpu_caps.CpuCaps(avx512_bf16=True, amx_tile=True), True, False, True),  # AMX Xeon
    (cpu_caps.CpuCaps(amx_tile=True, amx_fp16=True), True, True, True)])
def test_cpu_features_are_cpu_caps(monkeypatch, caps, bf16, fp16, tiles) -> None:
    monkeypatch.setattr(cpu_caps, "caps", lambda: caps)
    assert platform.cpu_computes_natively(torch.float32)
    assert platform.cpu_computes_natively(torch.bfloat16) is bf16
    assert platform.cpu_computes_natively(torch.float16) is fp16
    assert not platform.cpu_computes_natively(torch.int8)
    assert platform.cpu_has_matrix_tiles() is tiles


def test_last_level_cache_bytes_reads_the_highest_level(tmp_path) -> None:
    for index, level, size in (("index0", 1, "48K"), ("index2", 2, "2048K"),
                               ("index3", 3, "480M"), ("index1", 1, "32K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(f"{level}\n")
        (tmp_path / index / "size").write_text(f"{size}\n")
    (tmp_path / "uevent").write_text("")
    read = platform.last_level_cache_bytes.__wrapped__
    assert read(str(tmp_path)) == 480 << 20
    assert read(str(tmp_path / "missing")) == 0
    (tmp_path / "index3" / "size").write_text("unknown\n")
    assert read(str(tmp_path)) == 2048 << 10
