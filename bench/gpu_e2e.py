"""End-to-end decode on a CUDA GPU: mrv2 (CUDA graphs, and eager) against transformers'
`generate` on the same seeded weights, prompts and dtype, in the same run.

Run by hand on a machine with a GPU (CI has none):

    python bench/gpu_e2e.py --json out.json

Workloads: SmolLM2-135M's shape (30 layers of width 576) with random weights, batch 1 and
batch 32, 128 prompt tokens and 128 greedy tokens each. Prints output tokens/s per engine
(median of `--rounds`) and, per engine, the fraction of greedy tokens generated before the
first divergence from transformers in float32 (the reference): 16-bit runs of a random-weight
model meet near-ties early, so the figure that matters is mrv2's against transformers' own in
the same dtype. Reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from e2e_workload import HFRunner, Mrv2Runner, Workload  # noqa: E402

SMOLLM2_SHAPE = Workload("smollm2-shape", 576, 30, 9, 3, 1536, 49152, 32, 128, 128)


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens generated before the first divergence, over all requests."""
    same = total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same, total = same + n, total + len(x)
    return same / total


class _CudaHF(HFRunner):
    def __init__(self, w: Workload, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        from e2e_workload import model_dir

        model = AutoModelForCausalLM.from_pretrained(str(model_dir(w)), dtype=dtype)
        super().__init__(w, model.to("cuda").eval())
        self.input_ids = self.input_ids.cuda()
        self.attention_mask = self.attention_mask.cuda()

    def run(self) -> float:
        torch.cuda.synchronize()
        return super().run()


def _median_seconds(runner, rounds: int) -> float:
    runner.run()  # warm-up: kernel compiles, graph captures, allocator growth
    return statistics.median(runner.run() for _ in range(rounds))


def measure(w: Workload, dtype: str, rounds: int, reference: list[list[int]] | None
            ) -> tuple[dict, list[list[int]]]:
    """One row of figures, and transformers' tokens (the reference when `reference` is None:
    the float32 row)."""
    torch_dtype = getattr(torch, dtype)
    row: dict = {"workload": w.name, "batch": w.num_prompts, "dtype": dtype,
                 "input_len": w.input_len, "output_len": w.output_len}
    tokens = w.num_prompts * w.output_len
    hf = _CudaHF(w, torch_dtype)
    row["transformers_tok_s"] = tokens / _median_seconds(hf, rounds)
    hf_ids = hf.last_token_ids
    reference = reference or hf_ids
    row["transformers_agreement_with_float32"] = _prefix_agreement(hf_ids, reference)
    del hf
    for name, kwargs in (("mrv2_cudagraph", {}), ("mrv2_eager", {"enforce_eager": True})):
        start = time.perf_counter()
        mrv2 = Mrv2Runner(w, dtype=dtype, device="cuda", **kwargs)
        row[f"{name}_startup_s"] = time.perf_counter() - start
        row[f"{name}_tok_s"] = tokens / _median_seconds(mrv2, rounds)
        row[f"{name}_agreement_with_transformers"] = _prefix_agreement(mrv2.last_token_ids,
                                                                       hf_ids)
        row[f"{name}_agreement_with_float32"] = _prefix_agreement(mrv2.last_token_ids,
                                                                  reference)
        mrv2.shutdown()
        del mrv2
        torch.cuda.empty_cache()
    return row, hf_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_e2e.py needs a CUDA GPU")
    rows = []
    # float32 first: its transformers tokens are the reference of the 16-bit rows.
    dtypes = sorted(args.dtypes, key=lambda d: d != "float32")
    for batch in args.batches:
        reference = None
        for dtype in dtypes:
            row, hf_ids = measure(replace(SMOLLM2_SHAPE, num_prompts=batch), dtype,
                                  args.rounds, reference)
            if dtype == "float32":
                reference = hf_ids
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
