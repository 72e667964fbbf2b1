"""`mrv2 bench throughput` on a tiny model, in process."""

from __future__ import annotations

import json
import re

import pytest

from mrv2.entrypoints.bench.dataset import random_token_prompts
from mrv2.entrypoints.cli import main

THROUGHPUT_LINE = re.compile(r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, "
                             r"[\d.]+ output tokens/s$", re.M)


def test_bench_throughput_prints_vllm_line(tiny_llama, tmp_path, capsys):
    out_json = tmp_path / "t.json"
    code = main(["bench", "throughput", "--model", str(tiny_llama), "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "5", "--dataset", "random",
                 "--max-num-seqs", "4", "--output-json", str(out_json)])
    out = capsys.readouterr().out
    assert code == 0
    assert THROUGHPUT_LINE.search(out), out
    result = json.loads(out_json.read_text())
    assert result["num_requests"] == 3
    assert result["total_output_tokens"] == 15  # ignore_eos: exactly output_len each
    assert result["total_num_tokens"] == 3 * 8 + 15
    assert result["requests_per_second"] > 0 and result["input_len"] == 8


def test_random_prompts_are_seeded():
    a = random_token_prompts(3, 5, 100, seed=1)
    assert a == random_token_prompts(3, 5, 100, seed=1)
    assert a != random_token_prompts(3, 5, 100, seed=2)
    assert all(len(p) == 5 and all(10 <= t < 100 for t in p) for p in a)
    with pytest.raises(ValueError):
        random_token_prompts(0, 5, 100)
