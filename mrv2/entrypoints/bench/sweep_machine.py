"""What `mrv2 bench sweep` records about the machine: the CPU's kind and the instruction sets
that decide which precisions are worth running (read at run time from /proc/cpuinfo, or from
mrv2.cpu_caps, mrv2's own reading of the CPU, where that file is missing), the threads, the
load average.

mrv2's bfloat16 column (bf16 weights, float32 activations) runs its linears of several rows in
bf16 only where the CPU has instructions for it (avx512_bf16 or AMX); elsewhere every linear
widens the bf16 weights to float32 (docs/architecture.md, section 5), and the column says so.
"""

from __future__ import annotations

import os
import platform as _platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The flags the table's header names, as /proc/cpuinfo spells them.
FEATURE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# A load average above this (on these shared machines) labels the figures as measured under load.
LOADED_ABOVE = 1.5


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    family: str | None
    model: str | None
    flags: frozenset[str]
    threads: int
    source: str  # "/proc/cpuinfo" or "cpu_caps"

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def features(self) -> dict[str, bool]:
        return {flag: self.has(flag) for flag in FEATURE_FLAGS}

    @property
    def name(self) -> str:
        """'AMD EPYC (family 25, model 1)'."""
        where = ", ".join(f"{k} {v}" for k, v in (("family", self.family), ("model", self.model))
                          if v is not None)
        return f"{self.model_name} ({where})" if where else self.model_name

    @property
    def kind(self) -> str:
        """'AMD EPYC (family 25, model 1), avx2, 2 threads': the CPU named at a glance."""
        present = [flag for flag in FEATURE_FLAGS if self.has(flag)] or ["no avx2"]
        return f"{self.name}, {'/'.join(present)}, {self.threads} threads"

    def bf16_precision(self) -> str:
        """What mrv2's dtype="bfloat16" runs here, as the table names it: "bfloat16" where the
        CPU computes bf16 natively, "bf16 weights" (bf16 weights, float32 compute) elsewhere."""
        return "bfloat16" if any(self.has(flag) for flag in BF16_FLAGS) else "bf16 weights"

    def as_json(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "family": self.family, "model": self.model,
                "features": self.features, "threads": self.threads, "source": self.source,
                "name": self.name, "kind": self.kind}


def available_threads() -> int:
    """The cores this process may run on (its affinity), as every engine is given."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_cpuinfo(text: str, threads: int) -> CpuInfo | None:
    """The first processor's entry of a /proc/cpuinfo text; None without a flags line."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: all cores of these machines are alike
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags") or fields.get("Features")  # x86 / arm
    if flags is None:
        return None
    return CpuInfo(model_name=fields.get("model name") or _platform.processor() or "unknown CPU",
                   family=fields.get("cpu family"), model=fields.get("model"),
                   flags=frozenset(flags.split()), threads=threads, source="/proc/cpuinfo")


def _caps_cpu_info(threads: int) -> CpuInfo:
    """Where /proc/cpuinfo is missing: the same instruction sets as cpu_caps reads them (AMX's
    bf16 as its tiles, which is what mrv2's bfloat16 choice asks)."""
    from mrv2 import cpu_caps

    caps = cpu_caps.caps()
    present = {"avx2": caps.avx2, "avx512f": caps.avx512f, "avx512_bf16": caps.avx512_bf16,
               "amx_bf16": caps.amx_tile}
    return CpuInfo(model_name=_platform.processor() or _platform.machine() or "unknown CPU",
                   family=None, model=None, flags=frozenset(f for f in present if present[f]),
                   threads=threads, source="cpu_caps")


def read_cpu_info(path: str = "/proc/cpuinfo", threads: int | None = None) -> CpuInfo:
    """The CPU of this machine; `threads`: what the engines will use (default: the cores
    this process may run on)."""
    threads = threads or available_threads()
    try:
        info = parse_cpuinfo(Path(path).read_text(), threads)
    except OSError:
        info = None
    return info if info is not None else _caps_cpu_info(threads)


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
