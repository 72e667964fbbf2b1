"""End-to-end offline workloads W1/W2/W3 (issue 8) for mrv2 and for transformers `generate`.

Both engines get the same seeded random weights (mrv2.testing.make_tiny_model), the same
token-id prompts, greedy decoding with EOS ignored, float32 and 2 intra-op threads, so their
wall times can be compared as a ratio measured in the same run.

`reduced=True` shrinks a workload to a few layers and tokens: the CI pass under
`--benchmark-disable` checks that the case still runs without paying for the full sizes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

NUM_THREADS = 2
PROMPT_SEED = 1234


@dataclass(frozen=True)
class Workload:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_prompts: int
    input_len: int
    output_len: int

    @property
    def model_params(self) -> dict[str, Any]:
        return dict(hidden_size=self.hidden_size, num_layers=self.num_layers,
                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                    intermediate_size=self.intermediate_size, vocab_size=self.vocab_size)

    def reduced(self) -> "Workload":
        """Same architecture family, tiny sizes (CI smoke mode)."""
        return replace(self, name=self.name + "-reduced", num_layers=2,
                       num_prompts=min(self.num_prompts, 4), input_len=16, output_len=4)


W1 = Workload("W1", 512, 8, 8, 4, 1408, 16000, 32, 128, 128)
W2 = Workload("W2", 1024, 16, 16, 8, 2816, 16000, 32, 128, 128)
W3 = replace(W1, name="W3", num_prompts=1)
WORKLOADS = {w.name: w for w in (W1, W2, W3)}


def model_dir(w: Workload) -> Path:
    """Build (once, cached) the workload's llama model; seed 0."""
    from mrv2.testing import cache_root, make_tiny_model

    p = w.model_params
    tag = "-".join(str(v) for v in p.values())
    return make_tiny_model(cache_root() / "models" / f"bench-llama-{tag}", "llama", seed=0, **p)


def make_prompts(w: Workload, seed: int = PROMPT_SEED) -> list[list[int]]:
    """Random token ids in [10, vocab) (skipping the low special ids), fixed seed."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, w.vocab_size, (w.num_prompts, w.input_len)).tolist()


def set_threads() -> None:
    torch.set_num_threads(NUM_THREADS)


class Mrv2Runner:
    """An LLM built once (or `llm`, one built by the caller, with prefix caching off and room
    for the workload); `run()` generates the workload and returns seconds."""

    def __init__(self, w: Workload, llm: Any = None, **engine_kwargs: Any) -> None:
        from mrv2 import LLM, SamplingParams

        set_threads()
        self.w = w
        self.prompts = [{"prompt_token_ids": p} for p in make_prompts(w)]
        self.params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
        if llm is None:
            # Prefix caching off: every timed run repeats the warm-up's prompts, and a cache hit
            # would skip the prefill that transformers has to compute.
            kwargs = dict(dtype="float32", max_model_len=w.input_len + w.output_len + 16,
                          max_num_seqs=max(w.num_prompts, 1), seed=0, enable_prefix_caching=False)
            kwargs.update(engine_kwargs)
            llm = LLM(str(model_dir(w)), **kwargs)
        self.llm = llm
        set_threads()  # the worker sets threads from the core count; pin it for the ratio

    def run(self) -> float:
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        self.last_token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        assert all(len(t) == self.w.output_len for t in self.last_token_ids)
        return elapsed

    def shutdown(self) -> None:
        self.llm.shutdown()


class HFRunner:
    """transformers' `generate`: batch of all prompts, left padding (all prompts have the same
    length, so the mask is all ones), greedy, exactly output_len new tokens. `model`: one
    loaded by the caller (float32, eval) instead of the workload's seeded model."""

    def __init__(self, w: Workload, model: torch.nn.Module | None = None) -> None:
        from transformers import AutoModelForCausalLM

        set_threads()
        self.w = w
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir(w)),
                                                         dtype=torch.float32).eval()
        self.model = model
        self.input_ids = torch.tensor(make_prompts(w), dtype=torch.long)
        self.attention_mask = torch.ones_like(self.input_ids)

    @torch.inference_mode()
    def run(self) -> float:
        n = self.w.output_len
        start = time.perf_counter()
        out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention_mask,
                                  do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                  eos_token_id=None, pad_token_id=0)
        elapsed = time.perf_counter() - start
        self.last_token_ids = out[:, self.input_ids.shape[1]:].tolist()
        return elapsed


def throughput_info(w: Workload, seconds: float) -> dict[str, Any]:
    out_tokens = w.num_prompts * w.output_len
    return {"workload": asdict(w), "seconds": seconds, "output_tokens_per_s": out_tokens / seconds,
            "threads": torch.get_num_threads(), "dtype": "float32", "prompt_seed": PROMPT_SEED}
