"""Batch-1 decode of mrv2 (`quantization="gguf"`) against llama.cpp on W2-size random checkpoints
of the architectures the fused decode stack computes (llama, qwen2 with non-zero q/k/v biases,
qwen3 with q/k norms; gemma3 with --archs gemma3: Gemma 3's traits on W2's shape, a 512-token
window on five layers in six, the local rope, (1 + w) norms, GeLU), each as Q8_0 and Q4_0 GGUF:
one `mrv2 bench sweep` per file.

Each file is measured by `mrv2 bench sweep --engines mrv2:gguf,llama.cpp --batch-sizes 1` in a
child process of its own (the sweep's engine wrappers, prompts, metric and alternation: per
round, mrv2 then llama.cpp; one untimed round, then --repeats timed rounds, median). This script
only loops over the files and gathers the rows into one table with the mrv2 / llama.cpp ratio.

The files (see --build): bench/e2e_workload.W2's shape (hidden 1024, 16 layers, 16 heads / 8 KV
heads, head_dim 64, MLP 2816, vocab 16000, ~222M parameters), seed-0 random weights from
mrv2.testing.make_tiny_model (transformers' model classes, re-initialised per tensor), the mrv2
test tokenizer. Q8_0: llama.cpp's convert_hf_to_gguf.py --outtype q8_0 (every matrix Q8_0).
Q4_0: the converter's F32 file through llama.cpp's quantizer (llama_model_quantize, as
llama-quantize Q4_0: matrices Q4_0, output.weight Q6_K). The converter is run with two patches
(_CONVERT): the BPE pre-tokenizer name (it only knows the hashes of published tokenizers) and
sentencepiece's absence from the venv.

    python bench/fused_stack_vs_llama_cpp.py --out /tmp/qwen-fused.json
    python bench/fused_stack_vs_llama_cpp.py --build --llama-cpp-src \
        /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp --out /tmp/qwen-fused.json

The llama.cpp sources: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`,
unpacked; its vendor/llama.cpp directory. Options this script does not know are passed on to
every sweep (e.g. --num-scheduler-steps 8, --kv-cache-dtype float16, --threads 2).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "qwen3")
# Beyond W2's shape: Gemma 3 as llama.cpp reads its GGUF (every 6th layer global, the attention
# scale from head_dim), tied as released, a 1B-like window, and a vocabulary of the tokenizer's
# size (the converter keeps only the tokenizer's embedding rows, and llama.cpp wants as many as
# the file's token list has).
ARCH_PARAMS: dict[str, dict[str, Any]] = {
    "gemma3": {"tie_word_embeddings": True, "vocab_size": 2048, "config": {
        "sliding_window": 512, "query_pre_attn_scalar": 64,
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention"
                        for i in range(16)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}},
}
# Qwen3.5 (a hybrid: three gated delta rule layers to one of gated full attention) on W2's
# width: 16 layers, the linear-attention heads at W2's scale (8 key heads, 16 value heads of 64),
# partial rotary 0.25 with multimodal rope sections that fit its 16 rotary dims (llama.cpp
# asserts they do; text tokens rotate alike whatever the sections), the tokenizer's vocabulary.
# The converter needs --no-mtp for a checkpoint without the MTP head.
ARCH_PARAMS["qwen3_5"] = {"vocab_size": 2048, "rope_scaling": {
    "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "config": {"linear_num_key_heads": 8, "linear_num_value_heads": 16,
               "linear_key_head_dim": 64, "linear_value_head_dim": 64}}
CONVERT_ARGS = {"qwen3_5": ("--no-mtp",)}
TYPES = ("q8_0", "q4_0")
DEFAULT_DIR = Path("/tmp/w2models")

# convert_hf_to_gguf.py with its BPE pre-tokenizer check answered from tokenizer.json's split
# regex (mrv2.testing.gguf_vocab.bpe_pre_name, the name mrv2's own writer gives) and the
# sentencepiece import skipped where there is no tokenizer.model (it raises the FileNotFoundError
# sentencepiece's loader would, and the converter falls back to the GPT-2 BPE vocab).
# argv: <llama.cpp dir> <converter args...>
_CONVERT = r"""
import json, runpy, sys
from pathlib import Path
src = Path(sys.argv.pop(1))
sys.path[:0] = [str(src), str(src / "gguf-py"), REPO]
import conversion.base as base
from mrv2.testing.gguf_vocab import bpe_pre_name
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: bpe_pre_name(
    json.loads((Path(self.dir_model) / "tokenizer.json").read_text()))
_sp = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (Path(self.dir_model) / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {Path(self.dir_model) / 'tokenizer.model'}")
    return _sp(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv[0] = str(src / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
""".replace("REPO", repr(str(REPO)))


def gguf_path(models_dir: Path, arch: str, qtype: str) -> Path:
    return models_dir / f"{arch}-{qtype}.gguf"


def build(models_dir: Path, llama_cpp_src: Path, archs: list[str], types: list[str]) -> None:
    """The missing HF directories and GGUF files (see the module docstring)."""
    sys.path.insert(0, str(REPO))
    from bench.e2e_workload import W2
    from mrv2.testing import make_tiny_model

    if not (llama_cpp_src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"--llama-cpp-src {llama_cpp_src}: no convert_hf_to_gguf.py there")
    for arch in archs:
        hf_dir = make_tiny_model(models_dir / arch, arch, seed=0,
                                 **{**W2.model_params, **ARCH_PARAMS.get(arch, {})})
        for qtype in types:
            out = gguf_path(models_dir, arch, qtype)
            if out.exists():
                continue
            extra = CONVERT_ARGS.get(arch, ())
            if qtype == "q8_0":
                _convert(llama_cpp_src, hf_dir, out, "q8_0", extra)
                continue
            f32 = models_dir / f"{arch}-f32.gguf"
            if not f32.exists():
                _convert(llama_cpp_src, hf_dir, f32, "f32", extra)
            _quantize(f32, out, qtype)
            print(f"[qwen-fused] wrote {out}", file=sys.stderr, flush=True)


def _convert(src: Path, hf_dir: Path, out: Path, outtype: str, extra: tuple[str, ...] = ()
             ) -> None:
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(hf_dir), "--outfile", str(out),
                    "--outtype", outtype, *extra], check=True)


def _quantize(src: Path, dst: Path, qtype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
                    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[qtype]
    params.nthread = min(2, os.cpu_count() or 1)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} failed")


def sweep_one(path: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """One `mrv2 bench sweep` of the file, in a child interpreter: its JSON result."""
    with tempfile.TemporaryDirectory(prefix="qwen-fused-") as tmp:
        out = Path(tmp) / "sweep.json"
        cmd = [sys.executable, "-m", "mrv2.entrypoints.cli", "bench", "sweep",
               "--model", str(path), "--engines", "mrv2:gguf,llama.cpp", "--batch-sizes", "1",
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--repeats", str(args.repeats), "--format", "text", "--output-json", str(out),
               *extra]
        print(f"[qwen-fused] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, cwd=REPO, stdout=sys.stderr)
        return json.loads(out.read_text())


def row_of(arch: str, qtype: str, result: dict[str, Any]) -> dict[str, Any]:
    cells = {m["engine"]: m for m in result["measurements"] if m["batch"] == 1}
    mrv2, lcpp = (cells.get(e, {}).get("decode_tok_s_median") for e in ("mrv2", "llama.cpp"))
    machine = result["machine"]
    return {"file": result["model"], "arch": arch, "type": qtype,
            "gguf_type": result["engines"][0]["precision"] if result["engines"] else None,
            "mrv2_tok_s": mrv2, "llama_cpp_tok_s": lcpp,
            "mrv2_runs": cells.get("mrv2", {}).get("decode_tok_s"),
            "llama_cpp_runs": cells.get("llama.cpp", {}).get("decode_tok_s"),
            "ratio": mrv2 / lcpp if mrv2 and lcpp else None,
            "loadavg": [machine["loadavg_start"], machine["loadavg_end"]],
            "under_load": machine["under_load"],
            "skipped": result["skipped"]}


def format_table(rows: list[dict[str, Any]]) -> str:
    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [("| model | mrv2 gguf tok/s | llama.cpp tok/s | mrv2 / llama.cpp | load 1m "
              "start -> end |"), "|---|---:|---:|---:|---|"]
    for r in rows:
        load = " -> ".join(num(x, ".2f") for x in r["loadavg"])
        lines.append(f"| {r['arch']}-{r['type']} | {num(r['mrv2_tok_s'], '.1f')} | "
                     f"{num(r['llama_cpp_tok_s'], '.1f')} | {num(r['ratio'], '.3f')} | {load}"
                     f"{' (under load)' if r['under_load'] else ''} |")
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    if ratios:
        geo = statistics.geometric_mean(ratios)
        lines.append(f"\ngeometric mean of mrv2 / llama.cpp over {len(ratios)} files: {geo:.3f}")
    return "\n".join(lines)


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,
                              check=False).stdout.strip()  # "" outside a checkout

    return {"head": git("rev-parse", "HEAD"),
            "dirty_files": git("status", "--porcelain", "--untracked-files=no").splitlines()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="write the rows and every sweep's JSON here")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_DIR,
                        help=f"where the <arch>-<type>.gguf files are (default {DEFAULT_DIR})")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build", action="store_true", help="build the missing files first")
    parser.add_argument("--llama-cpp-src", type=Path, default=None,
                        help="llama.cpp sources with convert_hf_to_gguf.py (for --build)")
    args, extra = parser.parse_known_args()
    archs, types = args.archs.split(","), args.types.split(",")
    if args.build:
        if args.llama_cpp_src is None:
            parser.error("--build needs --llama-cpp-src")
        build(args.models_dir, args.llama_cpp_src, archs, types)
    files = [(a, t, gguf_path(args.models_dir, a, t)) for a in archs for t in types]
    if missing := [str(p) for _, _, p in files if not p.exists()]:
        parser.error(f"missing {', '.join(missing)} (build them with --build)")
    start = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
             "loadavg": Path("/proc/loadavg").read_text().strip(), **git_state()}
    rows, sweeps = [], {}
    for arch, qtype, path in files:
        result = sweep_one(path, args, extra)
        sweeps[f"{arch}-{qtype}"] = result
        rows.append(row_of(arch, qtype, result))
        table = format_table(rows)
        report = {"command": " ".join(sys.argv), "start": start,
                  "end_loadavg": Path("/proc/loadavg").read_text().strip(),
                  "complete": len(rows) == len(files),
                  "input_len": args.input_len, "output_len": args.output_len,
                  "repeats": args.repeats, "sweep_extra_args": extra, "rows": rows,
                  "table": table, "sweeps": sweeps}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")  # after every file
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
