"""Device choice: MRV2_DEVICE override, CUDA availability, caching, KV cache budget."""

from __future__ import annotations

import pytest
import torch

from mrv2 import platform


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


def test_gpu_kv_cache_default_is_a_fraction_of_free_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def mem_get_info(device):
        seen.append(device)
        return 10_000, 80_000

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    device = torch.device("cuda", 0)
    expected = int(10_000 * platform.DEFAULT_GPU_KV_CACHE_FRACTION)
    assert platform.default_kv_cache_bytes(device) == expected
    assert seen == [device]
