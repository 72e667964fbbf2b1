"""The machine facts of `mrv2 bench sweep`: /proc/cpuinfo's flags, and bf16 only where the CPU
has avx512_bf16 or AMX."""

from __future__ import annotations

from mrv2.entrypoints.bench.sweep_machine import (CpuInfo, available_threads, load_average,
                                                  parse_cpuinfo, read_cpu_info)

ZEN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma bmi2

processor\t: 1
model name\t: another core, never read
flags\t\t: fpu
"""
SAPPHIRE_RAPIDS = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_avx2_only_cpu_runs_bf16_weights():
    cpu = parse_cpuinfo(ZEN, threads=2)
    assert cpu is not None and cpu.source == "/proc/cpuinfo"
    assert (cpu.model_name, cpu.family, cpu.model) == ("AMD EPYC", "25", "1")
    assert cpu.features == {"avx2": True, "avx512f": False, "avx512_bf16": False,
                            "amx_bf16": False}
    assert cpu.kind == "AMD EPYC (family 25, model 1), avx2, 2 threads"
    assert cpu.bf16_precision() == "bf16 weights"
    assert cpu.as_json()["features"] == cpu.features


def test_bf16_cpu_runs_bf16():
    cpu = parse_cpuinfo(SAPPHIRE_RAPIDS, threads=8)
    assert cpu.bf16_precision() == "bfloat16"
    assert cpu.kind.endswith("avx2/avx512f/avx512_bf16/amx_bf16, 8 threads")
    avx512_only = CpuInfo("x", None, None, frozenset({"avx2", "avx512f"}), 4, "cpu_caps")
    assert avx512_only.bf16_precision() == "bf16 weights"
    assert avx512_only.kind == "x, avx2/avx512f, 4 threads"


def test_this_machine_and_the_cpu_caps_fallback(tmp_path):
    cpu = read_cpu_info()
    assert cpu.threads == available_threads() >= 1
    assert read_cpu_info(threads=1).threads == 1
    assert parse_cpuinfo("processor\t: 0\n", 1) is None  # no flags line
    fallback = read_cpu_info(str(tmp_path / "missing"))  # no /proc: cpu_caps
    assert fallback.source == "cpu_caps" and set(fallback.features) == set(cpu.features)
    if cpu.source == "/proc/cpuinfo":  # the two readings of one CPU agree
        assert fallback.features == cpu.features
    load = load_average()
    assert load is None or load >= 0
