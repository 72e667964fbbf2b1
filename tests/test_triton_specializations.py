"""No recompiles per step: every Triton kernel the runner launches compiles one variant per
configuration, whatever the batch (issue 15).

The runner's whole step (state updates, staged writes, input preparation, a model with one
paged-attention layer, the sampler, post_update) runs under Triton's interpreter over batches of
1, 3, 16 and 17 requests, prefill and decode steps, varied token counts. A test-only hook
records every launch made through `platform.triton_kernel`, and each launch gets the key Triton
would compile it under on a GPU. The key is computed by Triton's own code (triton 3.9):
`runtime/jit.py` `JITFunction.run` binds the arguments with the function that
`create_function_from_signature(signature, params, backend)` generates, which calls
`native_specialize_impl(backend, arg, is_const, specialize, align)` per non-constexpr argument
(integers: `("constexpr", 1)` for 1, attribute "D" when divisible by 16, i32 vs i64 by range;
tensors: dtype, "D" when `data_ptr() % 16 == 0`; `specialize=False` for names in
do_not_specialize), and caches compiled kernels by `compute_cache_key(specialization, options)`
= `str(specialization) + str(options)`. `BaseBackend.get_int_specialization` /
`get_tensor_specialization` (backends/compiler.py) decide the attributes; `CUDABackend`
(backends/nvidia/compiler.py) does not override them, so BaseBackend gives the CUDA key.

Launches are grouped by kernel and pointer dtypes (a kernel serving tensors of several dtypes,
like the staged writes, has one variant per dtype: fixed by the configuration); within a group,
all launches must share one key.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import mrv2
from mrv2 import platform
from mrv2.attention.backend import Attention, kv_cache_shape
from mrv2.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mrv2.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from mrv2.runner import ModelRunner
from mrv2.sampler.grammar_bitmask import apply_grammar_bitmask_
from mrv2.sampling_params import SamplingParams

pytest.importorskip("triton")

BLOCK_SIZE = 16
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 32
VOCAB = 64
HIDDEN = 32
HEAD_DIM = 16
BATCHES = (1, 3, 16, 17)  # requests running in turn (1, neither, a multiple of 16, not): each
# gets a prefill and a decode step


# ---- the hook: record every launch with the key Triton would compile it under ---------------
@dataclass
class Launch:
    kernel: str
    fn: Callable
    dns: tuple[str, ...]
    grid: tuple
    args: tuple
    kwargs: dict
    key: tuple  # (specialization, options), as triton's compute_cache_key sees them


@lru_cache(maxsize=None)
def _binder(fn: Callable, do_not_specialize: tuple[str, ...]) -> Callable:
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jitted = JITFunction(fn, do_not_specialize=list(do_not_specialize))
    return create_function_from_signature(jitted.signature, jitted.params, BaseBackend)


def compile_key(fn: Callable, do_not_specialize: tuple[str, ...], args: tuple,
                kwargs: dict) -> tuple:
    _, specialization, options = _binder(fn, do_not_specialize)(*args, **kwargs)
    return tuple(specialization), tuple(sorted(options.items()))


class _Recorded:
    """What `platform.triton_kernel` returns under the hook: the real kernel, logged."""

    def __init__(self, kernel: Any, fn: Callable, do_not_specialize: tuple[str, ...],
                 log: list[Launch]) -> None:
        self.kernel, self.fn, self.dns, self.log = kernel, fn, do_not_specialize, log

    def __getitem__(self, grid: tuple) -> Callable:
        def launch(*args: Any, **kwargs: Any) -> Any:
            # A jitted helper passed as a constexpr (paged attention's ATTEND_TILE) also came
            # through the hook: the kernel gets the real one.
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            key = compile_key(self.fn, self.dns, args, kwargs)
            self.log.append(Launch(self.fn.__name__, self.fn, self.dns, tuple(grid), args,
                                   kwargs, key))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _unwrap(value: Any) -> Any:
    return value.kernel if isinstance(value, _Recorded) else value


def _triton_modules() -> list:
    """Every mrv2 module that launches Triton kernels, imported now: a module first imported
    under the hook would keep the hook's function after it is gone."""
    names = [m.name for m in pkgutil.walk_packages(mrv2.__path__, "mrv2.")
             if m.name.endswith("_triton")]
    return [importlib.import_module(name) for name in names]


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    log: list[Launch] = []
    original = platform.triton_kernel

    def recording(fn: Callable, do_not_specialize: tuple[str, ...] = ()) -> _Recorded:
        return _Recorded(original(fn, do_not_specialize), fn, tuple(do_not_specialize), log)

    _triton_modules()
    monkeypatch.setattr(platform, "triton_kernel", recording)
    for module in list(sys.modules.values()):
        if module is not platform and getattr(module, "triton_kernel", None) is original:
            monkeypatch.setattr(module, "triton_kernel", recording)
    return log


def variants(launches: list[Launch]) -> dict[tuple, set[tuple]]:
    """(pointer dtypes) -> the distinct compile keys of launches with those dtypes."""
    groups: dict[tuple, set[tuple]] = defaultdict(set)
    for launch in launches:
        specialization, _ = launch.key
        dtypes = tuple(s[0] for s in specialization if str(s[0]).startswith("*"))
        groups[dtypes].add(launch.key)
    return groups


# ---- the workload: a fake model with one paged-attention layer, varied batches --------------
class _TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("embed", torch.randn(VOCAB, HIDDEN, generator=gen))
        self.register_buffer("lm_head", torch.randn(HIDDEN, VOCAB, generator=gen))
        self.attn = Attention(num_heads=HIDDEN // HEAD_DIM, head_dim=HEAD_DIM, num_kv_heads=1,
                              scale=HEAD_DIM ** -0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: Any) -> torch.Tensor:
        h = self.embed[input_ids.long()]
        kv = h[:, :HEAD_DIM].contiguous()
        return h + self.attn(h, kv, kv, kv_caches[0], meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head


def _config() -> EngineConfig:
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                         num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=1,
                         hidden_size=HIDDEN, vocab_size=VOCAB)
    return EngineConfig(
        model_config=ModelConfig(model="none", dtype=torch.float32,
                                 max_model_len=MAX_MODEL_LEN, hf_config=hf),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                         max_num_batched_tokens=512))


# Every sampler stage gets rows: greedy, seeded random, penalties, bias, logprobs.
PARAMS = (SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.8, seed=7),
          SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
          SamplingParams(temperature=0.0, logit_bias={3: 2.0, 9: -1.0}),
          SamplingParams(temperature=0.7, logprobs=2))


class _Workload:
    """Hand-built scheduler outputs; block ids handed out as positions need them."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, int] = {}
        self.next_block = 1  # 0 is the null block
        self.rng = np.random.default_rng(0)

    def _take(self, req_id: str, upto: int) -> list[int]:
        need = -(-upto // BLOCK_SIZE) - self.blocks.get(req_id, 0)
        self.blocks[req_id] = self.blocks.get(req_id, 0) + need
        self.next_block += need
        return list(range(self.next_block - need, self.next_block))

    def step(self, num_running: int) -> SchedulerOutput:
        """Cached rows decode one token; new ones bring prompts of varied lengths up to
        `num_running`; finished ones go when the batch shrinks."""
        running = list(self.computed)
        finished = running[num_running:]
        for req_id in finished:
            del self.computed[req_id]
        running = running[:num_running]
        cached_new = [[self._take(r, self.computed[r] + 1)] for r in running]  # one KV group
        cached = CachedRequestData.build(running, cached_new,
                                         [self.computed[r] for r in running])
        new, scheduled = [], {r: 1 for r in running}
        for i in range(len(running), num_running):
            req_id = f"r{self.next_block}-{i}"
            prompt = self.rng.integers(0, VOCAB, int(self.rng.integers(2, 40))).tolist()
            new.append(NewRequestData(req_id, prompt, prompt, PARAMS[i % len(PARAMS)],
                                      [self._take(req_id, len(prompt))], 0))
            scheduled[req_id] = len(prompt)
        for req_id, n in scheduled.items():
            self.computed[req_id] = self.computed.get(req_id, 0) + n
        return SchedulerOutput.build(new, cached, scheduled, sum(scheduled.values()),
                                     finished_req_ids=finished)


def run_workload(device: torch.device) -> None:
    """The runner's whole step over every batch size of BATCHES, then shrinking batches."""
    num_blocks = 1 + 2 * MAX_NUM_SEQS * (MAX_MODEL_LEN // BLOCK_SIZE)
    kv = [torch.zeros(kv_cache_shape(num_blocks, BLOCK_SIZE, 1, HEAD_DIM), device=device)]
    runner = ModelRunner(_config(), _TinyModel().to(device), kv, device)
    workload = _Workload()
    for num_reqs in BATCHES:
        for _ in range(2):  # the new ones' prefill, then a decode of all
            runner.execute_model(workload.step(num_reqs))
            runner.sample_tokens(None)
            _grammar_stage(num_reqs, device)
    for num_reqs in (5, 2):  # shrinking batches: finished rows, staged clears
        runner.execute_model(workload.step(num_reqs))
        runner.sample_tokens(None)
        _grammar_stage(num_reqs, device)


def _grammar_stage(num_reqs: int, device: torch.device) -> None:
    """The grammar bitmask stage the runner applies before sampling, launched here as the
    runner would on a step of `num_reqs` rows, every other row constrained (1 to 9 rows), so
    the workload needs no grammar engine."""
    gen = torch.Generator().manual_seed(num_reqs)
    rows = torch.arange(num_reqs - 1, -1, -2, device=device)
    bitmask = torch.randint(-2**31, 2**31, (len(rows), -(-VOCAB // 32)), generator=gen,
                            dtype=torch.int32).to(device)
    apply_grammar_bitmask_(torch.zeros(num_reqs, VOCAB, device=device), rows, bitmask)


@pytest.fixture(scope="module")
def launches() -> list[Launch]:
    with pytest.MonkeyPatch.context() as monkeypatch, platform.triton_interpreter():
        log = record_launches(monkeypatch)
        run_workload(torch.device("cpu"))
    return log


# Kernels whose owners do not yet keep per-step integers out of the specialisation.
KNOWN_RECOMPILING: dict[str, str] = {}  # kernel -> xfail reason naming the owner file
# A second variant the configuration allows: uniform decode batches pick a smaller query tile.
ALLOWED_VARIANTS = {"_paged_attention_kernel": 2}
RUNNER_KERNELS = ("_apply_runs_kernel", "_gather_rows_kernel", "_prepare_inputs_kernel",
                  "_post_update_kernel", "_reshape_and_cache_kernel", "_paged_attention_kernel",
                  "_gumbel_argmax_kernel", "_sparse_kernel", "_logprobs_kernel",
                  "_dense_kernel", "_grammar_bitmask_kernel")


def _param(name: str):
    reason = KNOWN_RECOMPILING.get(name)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("kernel", [_param(k) for k in RUNNER_KERNELS])
def test_one_variant_per_dtype_signature(launches: list[Launch], kernel: str) -> None:
    mine = [launch for launch in launches if launch.kernel == kernel]
    assert mine, f"{kernel} was not launched by the workload"
    for dtypes, keys in variants(mine).items():
        assert len(keys) <= ALLOWED_VARIANTS.get(kernel, 1), (f"{kernel} {dtypes}: {len(keys)} variants over "
                                f"{len(mine)} launches:\n" + "\n".join(map(str, keys)))


def test_every_launched_kernel_is_checked(launches: list[Launch]) -> None:
    assert {launch.kernel for launch in launches} <= set(RUNNER_KERNELS)


def test_workload_varies_the_batch(launches: list[Launch]) -> None:
    grids = {launch.grid for launch in launches if launch.kernel == "_prepare_inputs_kernel"}
    assert {(n + 1,) for n in BATCHES} <= grids


@pytest.mark.parametrize("kernel", ["_apply_runs_kernel", "_gather_rows_kernel",
                                    "_prepare_inputs_kernel"])
def test_workload_would_catch_specialised_counts(launches: list[Launch], kernel: str) -> None:
    """Keyed as if do_not_specialize were empty, the same launches compile several variants:
    the workload varies the per-step integers enough for the check above to mean something."""
    mine = [launch for launch in launches if launch.kernel == kernel]
    keys = {compile_key(launch.fn, (), launch.args, launch.kwargs) for launch in mine}
    assert mine[0].dns and len(keys) > len(variants(mine))


def test_key_follows_triton_rules() -> None:
    """The key function itself: integers specialise on 1 and on divisibility by 16, pointers on
    16-byte alignment, unless named in do_not_specialize."""
    def kernel(ptr, n, BLOCK):  # annotations are read from the source: see below
        pass

    def key(fn: Callable, dns: tuple[str, ...], *args: Any) -> tuple:
        return compile_key(fn, dns, args, {})[0]

    buf = torch.zeros(8, dtype=torch.int64)
    assert len({key(kernel, (), buf, n, 4) for n in (1, 16, 17, 33)}) == 3
    assert len({key(kernel, ("n",), buf, n, 4) for n in (1, 16, 17, 33)}) == 1
    assert key(kernel, (), buf, 17, 4) != key(kernel, (), buf[1:], 17, 4)
    assert key(kernel, ("ptr",), buf, 17, 4) == key(kernel, ("ptr",), buf[1:], 17, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_keys_match_what_triton_compiles_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, the same run compiles exactly the variants the hook's keys predict."""
    monkeypatch.setattr(platform, "_jitted", {})  # fresh kernels: their caches count this run
    log = record_launches(monkeypatch)
    run_workload(torch.device("cuda"))
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    predicted: dict[str, set[tuple]] = defaultdict(set)
    for launch in log:
        predicted[launch.kernel].add(launch.key)
    for kernel in platform._jitted.values():
        kernel_cache = kernel.device_caches[device][0]
        assert len(kernel_cache) == len(predicted[kernel.fn.__name__]), kernel.fn.__name__
