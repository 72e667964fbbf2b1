"""Per-sample comparison of run.sh's lm-eval outputs: hf against mrv2 on each task."""

from __future__ import annotations

import glob
import json
import sys


def samples(out: str, run: str) -> dict[int, dict]:
    (path,) = glob.glob(f"{out}/{run}/**/samples_*.jsonl", recursive=True)
    with open(path) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def main(out: str) -> None:
    hf, mrv2 = samples(out, "hf_mc"), samples(out, "mrv2_mc")
    diffs = [abs(float(a[0][0]) - float(b[0][0])) for d in hf
             for a, b in zip(hf[d]["resps"], mrv2[d]["resps"])]
    print(f"multiple choice: {len(diffs)} log-likelihoods, max |hf - mrv2| = {max(diffs):.2e}")
    hf, mrv2 = samples(out, "hf_gen"), samples(out, "mrv2_gen")
    same = sum(hf[d]["resps"][0][0] == mrv2[d]["resps"][0][0] for d in hf)
    print(f"generation: {same} / {len(hf)} greedy completions identical")


if __name__ == "__main__":
    main(sys.argv[1])
