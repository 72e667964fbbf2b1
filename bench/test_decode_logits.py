"""The LM head inside the fused decode stack against the head's own call after it, on the
built-in SmolLM2-135M Q4_1 GGUF (`quantization="gguf"`), one LLM for both cases.

Batch 1 and 8 of fixed token-id prompts, greedy, 64 tokens, EOS ignored, prefix caching off,
2 threads. `in_stack`: the stack's call computes the rows' logits (decode_logits.py);
`compute_logits`: the same engine with the head taken out of the stack, so the runner's
`compute_logits` runs its own GEMV after the stack's call (the code before the head moved
in). Each timed round generates 64 tokens and then 1: extra_info `decode_tokens_per_s` = 63 *
batch / (median 64-token seconds - 2 x median 1-token seconds). Compare the two cases of one run
(bench/README.md has the figures).

Under `--benchmark-disable` (CI) each case runs once with 4 tokens and checks which path gave
the logits.
"""

from __future__ import annotations

import pytest

from gguf_workload import (decode_case, gguf_path, greedy_timer, shutdown_after_module,
                           token_id_prompts)

ROUNDS = 5
OUTPUT_LEN = 64
_LLMS: dict[str, object] = {}

pytestmark = pytest.mark.usefixtures("two_threads")  # bench/conftest.py

_shutdown = shutdown_after_module(_LLMS)


def _llm():
    from mrv2 import LLM

    if "gguf" not in _LLMS:
        _LLMS["gguf"] = LLM(str(gguf_path()), max_model_len=256, max_num_seqs=8,
                            enable_prefix_caching=False, quantization="gguf")
    return _LLMS["gguf"]


@pytest.mark.parametrize("head", ["in_stack", "compute_logits"])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_logits(benchmark, monkeypatch, batch, head):
    llm = _llm()
    fused = llm.llm_engine.engine_core.executor.worker.runner.fused_decode
    assert fused.head is not None
    if head == "compute_logits":
        monkeypatch.setattr(fused, "head", None)
    monkeypatch.setattr(fused, "args", None)  # rebuilt with (or without) the head
    taken = {"n": 0}
    real_forward = fused.forward

    def counted(*args):  # the steps whose logits the stack handed the runner
        stepped = real_forward(*args)
        taken["n"] += stepped is not None and stepped[1] is not None
        return stepped

    monkeypatch.setattr(fused, "forward", counted)
    generate = greedy_timer(llm, token_id_prompts(batch, 32))
    tokens = 4 if benchmark.disabled else OUTPUT_LEN

    benchmark.group = f"decode-logits-b{batch}"
    decode_case(benchmark, generate, tokens, batch, ROUNDS, lambda: taken["n"] > 0,
                head == "in_stack", head=head)
