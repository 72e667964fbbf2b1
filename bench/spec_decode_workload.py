"""Speculative decoding on a copy-heavy workload (issue 52): mrv2 without drafts, with ngram
and with suffix drafts, and llama.cpp with and without its prompt-lookup decoding, on the
same GGUF file (the built-in SmolLM2 by default), greedy, in one run, alternating.

Copy-heavy prompts ask the model to repeat, edit or reformat text they contain; the
"no repetition" prompts ask for new text. Reported per engine and batch size: median decode
tok/s (generated tokens / wall time of the batch), drafts accepted, and same-run ratios.
Greedy outputs of every mrv2 configuration must be identical (speculation is lossless).

    PYTHONPATH=. python bench/spec_decode_workload.py --output-json bench/spec-....json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

TEXTS = [
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):"
    "\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:"
    "\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n    return out\n",
    "The committee met on Tuesday to review the budget. Travel costs rose by twelve percent, "
    "while equipment spending fell by four percent. The chair asked each team to submit a "
    "revised plan by Friday, with a short note explaining any change above five percent.",
    "name,age,city\nAlice,34,Paris\nBob,27,Berlin\nCarla,45,Madrid\nDaniel,31,Rome\n"
    "Eva,29,Vienna\nFrank,52,Lisbon\n",
    "Step 1: preheat the oven to 200 degrees. Step 2: mix the flour, sugar and butter. Step 3:"
    " add two eggs and stir. Step 4: pour into a tin and bake for thirty minutes. Step 5: let "
    "it cool before slicing.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text, changing nothing but making every line end with a period:"
    "\n\n{}",
    "Copy the following text and then copy it once more:\n\n{}",
    "Reformat the following text as a numbered list, keeping every word:\n\n{}",
]
FRESH = ["Write a short story about a lighthouse keeper.",
         "Explain how a bicycle gear works.",
         "Describe a day at a busy market.",
         "Give advice to someone learning to cook."]
METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def chat_prompts(kind: str, count: int) -> list[list[dict[str, str]]]:
    if kind == "copy":
        texts = [INSTRUCTIONS[i % len(INSTRUCTIONS)].format(TEXTS[i % len(TEXTS)])
                 for i in range(count)]
    else:
        texts = [FRESH[i % len(FRESH)] for i in range(count)]
    return [[{"role": "user", "content": t}] for t in texts]


def run_mrv2(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from mrv2 import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def accepted(llm) -> tuple[int, int]:
    counts = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return (counts.get("vllm:spec_decode_num_accepted_tokens", 0),
            counts.get("vllm:spec_decode_num_draft_tokens", 0))


def llama_cpp_engines(model: str, threads: int) -> dict[str, Any]:
    """llama.cpp on the same file, without and with prompt-lookup drafts; {} without it."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return {}
    common = dict(model_path=model, n_ctx=2048, n_threads=threads, verbose=False,
                  logits_all=False)
    return {"llama.cpp": Llama(**common),
            "llama.cpp+lookup": Llama(**common,
                                      draft_model=LlamaPromptLookupDecoding(num_pred_tokens=5))}


def run_llama_cpp(llama, prompt_ids: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """One request at a time (its high-level API decodes one sequence)."""
    tokens = 0
    start = time.perf_counter()
    for ids in prompt_ids:
        out = llama.create_completion(ids, max_tokens=max_tokens, temperature=0.0)
        tokens += out["usage"]["completion_tokens"]
    return time.perf_counter() - start, tokens


def workload_parser() -> argparse.ArgumentParser:
    """The options every speculative-decoding workload takes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file (default: built-in SmolLM2)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--kinds", default="copy,fresh")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    return parser


def time_engines(engines: dict[str, Any], prompts, max_tokens: int, repeats: int,
                 also=None) -> tuple[dict[str, list[float]], dict[str, int],
                                     dict[str, list[list[int]]]]:
    """Each engine on `prompts`, once untimed (first calls, page-in), then `repeats` rounds
    alternating (`also()`, if given, at the end of each round): (seconds per round, tokens
    generated, token ids) per engine."""
    times: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    outputs: dict[str, list[list[int]]] = {}
    for llm in engines.values():
        run_mrv2(llm, prompts, max_tokens)
    for _ in range(repeats):
        for name, llm in engines.items():
            seconds, outputs[name] = run_mrv2(llm, prompts, max_tokens)
            times.setdefault(name, []).append(seconds)
            counts[name] = sum(map(len, outputs[name]))
        if also is not None:
            also(times, counts)
    return times, counts, outputs


def add_row(results: dict[str, Any], row: dict[str, Any]) -> None:
    results["rows"].append(row)
    print(json.dumps(row))


def save_results(results: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from mrv2 import LLM
    from mrv2.models.builtin import builtin_model_path

    model = args.model or str(builtin_model_path())
    engines = {name: LLM(model, speculative_config=spec, kv_cache_memory_gb=1.0)
               for name, spec in METHODS.items()}
    tokenizer = engines["none"].get_tokenizer()
    peers = llama_cpp_engines(model, args.threads)
    results: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "rows": []}
    for kind in args.kinds.split(","):
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = chat_prompts(kind, batch)
            prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template(
                p, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
                for p in prompts]

            def peer_round(times, counts, prompt_ids=prompt_ids, batch=batch):
                for name, llama in (peers.items() if batch == 1 else ()):
                    seconds, counts[name] = run_llama_cpp(llama, prompt_ids, args.max_tokens)
                    times.setdefault(name, []).append(seconds)

            times, counts, outputs = time_engines(engines, prompts, args.max_tokens,
                                                  args.repeats, peer_round)
            lossless = all(o == outputs["none"] for o in outputs.values())
            row = {"kind": kind, "batch": batch, "lossless": lossless,
                   "tok_s": {n: counts[n] / statistics.median(t) for n, t in times.items()},
                   "accepted/drafted": {n: accepted(engines[n]) for n in engines}}
            row["ratios"] = {f"{n}/none": row["tok_s"][n] / row["tok_s"]["none"]
                             for n in row["tok_s"] if n != "none"}
            for name in ("ngram", "suffix"):
                if "llama.cpp+lookup" in row["tok_s"]:
                    row["ratios"][f"{name}/llama.cpp+lookup"] = (
                        row["tok_s"][name] / row["tok_s"]["llama.cpp+lookup"])
            add_row(results, row)
    save_results(results, args.output_json)


if __name__ == "__main__":
    main()
