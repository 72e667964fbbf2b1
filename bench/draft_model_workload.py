"""Draft-model and EAGLE speculation (issue 52) on the built-in SmolLM2 GGUF, same run,
alternating:

- the file as mrv2 runs it by default, without drafts and with a draft made of its own first
  `--draft-layers` layers (bench/truncated_gguf.py; untrained as a draft: it shows what a
  draft that seldom agrees costs, and how the adaptive backoff bounds it), and with a random
  EAGLE-1 head of its shape (mrv2/testing/tiny_eagle.py: no trained head exists for it; what
  the head's catch-up on every step and its rejected drafts cost);
- the file dequantized to float32 (`dtype="float32"`), without drafts and with the file's own
  Q4_1 blocks as the draft (`quantization="gguf"`): the same weights at a quarter of the bytes,
  so nearly every draft is accepted.

SmolLM2-135M is the smallest of its family: no smaller trained model shares its tokenizer.
Reported per kind and batch size: median decode tok/s (generated tokens / wall time of the
batch), accepted/drafted, whether each pair's greedy tokens are identical, and the ratios.

    PYTHONPATH=. python bench/draft_model_workload.py --output-json bench/draft-....json
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from spec_decode_workload import (accepted, add_row, chat_prompts, save_results, time_engines,
                                  workload_parser)
from truncated_gguf import truncate_gguf


def engines(model: str, draft_layers: int, k: int, workdir: Path) -> dict[str, Any]:
    from mrv2 import LLM

    from mrv2.testing.tiny_eagle import make_eagle_head

    truncated = truncate_gguf(model, workdir / f"first-{draft_layers}.gguf", draft_layers)
    head = make_eagle_head(workdir / "eagle-random", model)
    common = {"kv_cache_memory_gb": 1.0}
    return {
        "q4_1": LLM(model, **common),
        f"q4_1+first{draft_layers}": LLM(model, speculative_config={
            "model": str(truncated), "num_speculative_tokens": k}, **common),
        "q4_1+eagle(random)": LLM(model, speculative_config={
            "method": "eagle", "model": str(head), "num_speculative_tokens": k}, **common),
        "float32": LLM(model, dtype="float32", **common),
        "float32+q4_1": LLM(model, dtype="float32", speculative_config={
            "model": model, "quantization": "gguf", "num_speculative_tokens": k}, **common),
    }


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    from mrv2.models.builtin import builtin_model_path

    model = args.model or str(builtin_model_path())
    with tempfile.TemporaryDirectory() as workdir:
        llms = engines(model, args.draft_layers, args.num_speculative_tokens, Path(workdir))
        names = list(llms)
        pairs = [(names[0], names[1]), (names[0], names[2]),
                 (names[3], names[4])]  # (no drafts, drafts)
        results: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens,
                                   "num_speculative_tokens": args.num_speculative_tokens,
                                   "rows": []}
        for kind in args.kinds.split(","):
            for batch in map(int, args.batch_sizes.split(",")):
                prompts = chat_prompts(kind, batch)
                before = {n: accepted(llm) for n, llm in llms.items()}
                times, counts, outputs = time_engines(llms, prompts, args.max_tokens,
                                                      args.repeats)
                tok_s = {n: counts[n] / statistics.median(t) for n, t in times.items()}
                row = {"kind": kind, "batch": batch, "tok_s": tok_s,
                       "accepted/drafted": {n: [a - b for a, b in zip(accepted(llm), before[n])]
                                            for n, llm in llms.items()},
                       "lossless": {d: outputs[d] == outputs[p] for p, d in pairs},
                       "ratios": {f"{d}/{p}": tok_s[d] / tok_s[p] for p, d in pairs}}
                add_row(results, row)
    save_results(results, args.output_json)


if __name__ == "__main__":
    main()
