"""cpu_caps: the features read agree with /proc/cpuinfo, `read` takes LLVM's features and
torch's probes (and survives either missing), the kernel choices follow their fields on each
CPU kind, the kernel switches are parsed and checked, and no other module under mrv2/ reads
the CPU's features or a kernel switch itself."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from mrv2 import cpu_caps
from mrv2.cpu_caps import CpuCaps

# CpuCaps field -> its /proc/cpuinfo flag.
CPUINFO_FLAGS = {"avx2": "avx2", "avx512f": "avx512f", "avx512bw": "avx512bw",
                 "avx512vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
                 "amx_tile": "amx_tile", "amx_fp16": "amx_fp16", "int8_vnni": "avx512_vnni"}
FEATURES = ("avx2", "avx512f", "avx512bw", "avx512vnni", "avx512_bf16", "amx_tile", "amx_fp16",
            "int8_vnni")
ZEN3 = CpuCaps(numba_targets_host=True, avx2=True)
ZEN4 = dataclasses.replace(ZEN3, avx512f=True, avx512bw=True, avx512vnni=True,
                           avx512_bf16=True)
AMX_XEON = dataclasses.replace(ZEN4, amx_tile=True)


def _cpuinfo_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return None if line is None else set(line.split(":", 1)[1].split())


def test_caps_agree_with_proc_cpuinfo():
    flags = _cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags on this OS")
    caps = cpu_caps.caps()
    assert {f: getattr(caps, f) for f in CPUINFO_FLAGS} == {
        f: flag in flags for f, flag in CPUINFO_FLAGS.items()}
    assert caps is cpu_caps.caps()  # read once per process


def test_read_takes_llvm_features_and_torch_probes(monkeypatch):
    from llvmlite import binding
    from numba.core import config
    monkeypatch.setattr(config, "CPU_NAME", None)
    monkeypatch.setattr(binding, "get_host_cpu_features",
                        lambda: {"avx2": True, "avx512f": True, "avx512bw": True,
                                 "avx512vnni": False, "avx512bf16": True, "amx-tile": True})
    for probe, value in (("_is_avx512_bf16_supported", False), ("_is_amx_tile_supported", False),
                         ("_is_amx_fp16_supported", True), ("_is_vnni_supported", True)):
        monkeypatch.setattr(torch.cpu, probe, lambda value=value: value, raising=False)
    caps = cpu_caps.read({})
    # LLVM's for what numba compiles, torch's (not LLVM's avx512bf16 / amx-tile) for oneDNN's
    assert {f: getattr(caps, f) for f in FEATURES} == {
        "avx2": True, "avx512f": True, "avx512bw": True, "avx512vnni": False,
        "avx512_bf16": False, "amx_tile": False, "amx_fp16": True, "int8_vnni": True}
    monkeypatch.setattr(config, "CPU_NAME", "skylake")  # numba compiles for another CPU
    assert not cpu_caps.read({}).numba_targets_host


def test_read_survives_missing_sources(monkeypatch):
    from llvmlite import binding

    def fails():
        raise RuntimeError("failed to get host cpu features.")

    monkeypatch.setattr(binding, "get_host_cpu_features", fails)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported",
                  "_is_amx_fp16_supported", "_is_vnni_supported"):
        monkeypatch.delattr(torch.cpu, probe, raising=False)  # an older torch
    caps = cpu_caps.read({})
    assert not any(getattr(caps, f) for f in FEATURES)
    assert caps.vector_floats == 8 and not caps.native_16bit(torch.bfloat16)


@pytest.mark.parametrize("caps, floats, int8, vnni, panels, bf16, tiles", [
    (CpuCaps(), 8, False, False, False, False, False),
    (ZEN3, 8, True, False, False, False, False),
    (ZEN4, 16, True, True, True, True, False),
    (AMX_XEON, 16, True, True, True, True, True),
    (dataclasses.replace(AMX_XEON, numba_targets_host=False), 16, False, False, False, True,
     True)])
def test_kernel_choices_per_cpu_kind(caps, floats, int8, vnni, panels, bf16, tiles):
    assert caps.vector_floats == floats
    assert (caps.int8_dots, caps.vnni_dots, caps.group_panels) == (int8, vnni, panels)
    assert caps.native_16bit(torch.bfloat16) is bf16
    assert caps.matrix_tiles is tiles
    assert caps.native_16bit(torch.float32) and not caps.native_16bit(torch.int8)


@pytest.mark.parametrize("choice, needs", [
    ("int8_dots", ("numba_targets_host", "avx2")),
    ("vnni_dots", ("numba_targets_host", "avx512vnni", "avx512bw", "avx512f")),
    ("group_panels", ("numba_targets_host", "avx512f", "avx512bw"))])
def test_each_intrinsic_choice_needs_every_field(choice, needs):
    full = dataclasses.replace(AMX_XEON, amx_fp16=True)
    assert getattr(full, choice)
    for field in needs:
        assert not getattr(dataclasses.replace(full, **{field: False}), choice), field


def test_native_16bit_follows_its_instructions():
    assert CpuCaps(avx512_bf16=True).native_16bit(torch.bfloat16)
    assert CpuCaps(amx_tile=True).native_16bit(torch.bfloat16)
    assert not CpuCaps(amx_tile=True).native_16bit(torch.float16)
    assert CpuCaps(amx_fp16=True).native_16bit(torch.float16)
    assert not CpuCaps(amx_fp16=True).native_16bit(torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CpuCaps().avx2 = True


@pytest.mark.parametrize("environ, choice", [
    ({}, ""), ({"MRV2_GGUF_ACTIVATIONS": " INT8 "}, "int8"),
    ({"MRV2_GGUF_ACTIVATIONS": "float32"}, "float32"),
    ({"MRV2_GGUF_INT8_ACTIVATIONS": "1"}, "int8"),  # the older spelling
    ({"MRV2_GGUF_INT8_ACTIVATIONS": "0"}, ""),
    ({"MRV2_GGUF_ACTIVATIONS": "int16", "MRV2_GGUF_INT8_ACTIVATIONS": "1"}, "int16")])
def test_gguf_activations_switch(environ, choice):
    assert cpu_caps.read(environ).gguf_activations == choice


@pytest.mark.parametrize("environ, choice", [
    ({}, ""), ({"MRV2_GGUF_PREFILL": " BF16 "}, "bf16"), ({"MRV2_GGUF_PREFILL": "int8"}, "int8")])
def test_gguf_prefill_switch(environ, choice):
    assert cpu_caps.read(environ).gguf_prefill == choice
    with pytest.raises(ValueError, match=r"MRV2_GGUF_PREFILL='fp8': expected one of "
                                         r"\['bf16', 'int8'\]"):
        cpu_caps.read({"MRV2_GGUF_PREFILL": "fp8"})


def test_a_bad_gguf_activations_value_names_the_variable():
    with pytest.raises(ValueError, match=r"MRV2_GGUF_ACTIVATIONS='fp4': expected one of "
                                         r"\['float32', 'int16', 'int8'\]"):
        cpu_caps.read({"MRV2_GGUF_ACTIVATIONS": "fp4"})
    with pytest.raises(ValueError, match="MRV2_GGUF_ACTIVATIONS='int4'"):
        CpuCaps(gguf_activations="int4")


_PROBE = re.compile(r"_is_\w+_supported")


def _feature_reads(path: Path) -> list[str]:
    """Where `path` calls LLVM's host features or a torch probe, or names a kernel switch (an
    attribute, an imported name, or a string equal to one: docstrings may mention them)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.alias):
            names = [node.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        for name in names:
            if (name == "get_host_cpu_features" or _PROBE.fullmatch(name)
                    or name in cpu_caps.KERNEL_SWITCHES):
                found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_only_cpu_caps_reads_the_cpu_and_the_kernel_switches():
    package = Path(cpu_caps.__file__).parent
    own = _feature_reads(Path(cpu_caps.__file__))
    # the scan finds each kind of read where it is (else it could pass by finding nothing)
    assert any("get_host_cpu_features" in r for r in own)
    assert any("_is_amx_tile_supported" in r for r in own)
    assert all(any(name in r for r in own) for name in cpu_caps.KERNEL_SWITCHES)
    others = [read for path in sorted(package.rglob("*.py"))
              if path.name != "cpu_caps.py" or path.parent != package
              for read in _feature_reads(path)]
    assert others == []
