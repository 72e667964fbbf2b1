"""The engines `mrv2 bench sweep` compares, each behind one call: `generate(prompts,
max_tokens)` -> the tokens of every prompt, greedy, EOS ignored, exactly `max_tokens` each.

- mrv2 at its defaults (`LLM(model)`, as a new user runs it), and in each precision it has:
  float32 weights (a GGUF file dequantized at load), `quantization="gguf"` (a quantized GGUF
  file's blocks, as stored), dtype="bfloat16" (bf16 weights; linears of several rows in bf16
  where the CPU computes it, else widened to float32: sweep_machine.CpuInfo.bf16_precision);
- transformers' `generate`, float32, on the same weights: for a GGUF file its safetensors twin
  (mrv2/testing/gguf_twin.py: transformers' own reading of the file, saved once);
- llama.cpp on the same GGUF file, through llama-cpp-python's bindings of its C API: every
  prompt a sequence of one batch, one `llama_decode` per step (as llama.cpp's server batches);
- vLLM (`vllm.LLM`, prefix caching off), float32 and bfloat16 (its CPU default; only where the
  CPU computes bf16 natively: emulated, a batch-1 run took over 7 minutes on a Zen 3), on the
  weights transformers runs, in a child interpreter (vllm_peer.py says why; `MRV2_VLLM_PYTHON`
  may name another environment's).
The peers are optional (pyproject's `peers` extra): one that does not import is skipped, and
the reason is printed."""

from __future__ import annotations

import gc
import importlib
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from mrv2.entrypoints.bench import vllm_peer
from mrv2.entrypoints.bench.sweep_roofline import ModelShapes
from mrv2.utils import free_cores

# --engines names: an engine, or one precision of mrv2.
MRV2_KEYS = ("mrv2:default", "mrv2:float32", "mrv2:gguf", "mrv2:bf16")
VLLM_KEYS = ("vllm:float32", "vllm:bf16")
ENGINE_KEYS = MRV2_KEYS + ("transformers", "llama.cpp") + VLLM_KEYS
PEER_PACKAGES = {"llama.cpp": ("llama_cpp", "llama-cpp-python")}  # vLLM: vllm_peer.probe
CONTEXT_MARGIN = 16  # room above input + output in each engine's context (as e2e_workload's)
LLAMA_CPP_BATCH_TOKENS = 512  # tokens per llama_decode of llama.cpp's prefill (n_batch, n_ubatch)


@dataclass(frozen=True)
class EngineSpec:
    key: str  # one of ENGINE_KEYS
    engine: str  # as the table names it
    precision: str

    @property
    def column(self) -> str:
        return f"{self.engine} {self.precision}"


@dataclass(frozen=True)
class Skip:
    engine: str
    reason: str

    def line(self) -> str:
        return f"skipped {self.engine}: {self.reason}"


@dataclass(frozen=True)
class SweepSetup:
    """What every engine is loaded for: the largest batch, the context, seed, threads."""

    max_batch: int
    input_len: int
    output_len: int
    seed: int
    threads: int
    num_scheduler_steps: int | None = None  # mrv2's (SchedulerConfig.num_scheduler_steps)
    kv_cache_dtype: str = "auto"  # mrv2's (CacheConfig.cache_dtype)

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len + CONTEXT_MARGIN


@dataclass
class SweepModel:
    """The checkpoint every engine runs: a local directory or GGUF file."""

    path: str
    name: str
    is_gguf: bool
    vocab_size: int  # prompt ids stay below the model's and the tokenizer's vocabulary
    kv_bytes_per_token: int  # float32 K and V, all layers
    gguf_type: str | None = None  # the GGUF's main weight type ("Q4_1")
    shapes: ModelShapes | None = None  # for the roofline limit
    _hf_dir: str | None = field(default=None, repr=False)

    def hf_dir(self) -> str:
        """The float32 checkpoint transformers and vLLM load: the directory, or the GGUF's
        safetensors twin (built on first use: transformers' GGUF load, tens of seconds once)."""
        if self._hf_dir is None:
            if self.is_gguf:
                from mrv2.testing.gguf_twin import safetensors_twin

                self._hf_dir = str(safetensors_twin(Path(self.path)))
            else:
                self._hf_dir = self.path
        return self._hf_dir


def read_sweep_model(model: str) -> SweepModel:
    """The user's model (directory, GGUF file, Hub id) as a local checkpoint, read as mrv2's
    engine reads it; nothing is loaded yet."""
    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.models.gguf.checkpoint import is_gguf_path, open_gguf
    from mrv2.models.tokenizer import load_tokenizer

    config = EngineArgs(model=model).create_engine_config().model_config
    tokenizer = load_tokenizer(config.tokenizer_path)
    vocab = config.vocab_size if tokenizer is None else min(config.vocab_size, len(tokenizer))
    gguf = is_gguf_path(config.model)
    tensors = open_gguf(config.model).tensors if gguf else {}
    layer_matrices = [t for name, t in tensors.items()
                      if name.startswith("blk.") and len(t.shape) == 2]
    # the most frequent type of the layers' weights: the file's quantization
    types = Counter(t.type_name for t in layer_matrices)
    gguf_type = types.most_common(1)[0][0] if types else None
    shapes = _shapes(config, tensors, layer_matrices)
    path = Path(config.model)
    name = path.stem if gguf else path.name
    return SweepModel(config.model, name, gguf, vocab, shapes.kv_bytes_per_token, gguf_type,
                      shapes)


def _shapes(config: Any, tensors: dict[str, Any], layer_matrices: list[Any]) -> ModelShapes:
    """The checkpoint's decoder shapes and its weights' stored bytes: a GGUF's layer matrices
    and LM head (output.weight, or the tied token_embd.weight) as blocks and top_k / E of its
    3-D expert tensors (`tensors`, empty for a directory); a directory's at its dtype's width."""
    hf = config.hf_config
    heads = hf.num_attention_heads
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 1
    top_k = getattr(hf, "num_experts_per_tok", 0) if experts > 1 else 0
    # a MoE row multiplies its top-k experts only; a step reads at least those of each layer
    width = (getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size) * (top_k or 1)
    shapes = ModelShapes(config.num_layers, hf.hidden_size, heads * config.head_dim,
                         config.num_kv_heads * config.head_dim, width, hf.vocab_size, 0)
    if tensors:
        head = tensors.get("output.weight", tensors.get("token_embd.weight"))
        nbytes = sum(t.data.nbytes for t in layer_matrices) + sum(
            t.data.nbytes for name, t in tensors.items()
            if name.startswith("blk.") and len(t.shape) == 3) * top_k // experts
        nbytes += 0 if head is None else head.data.nbytes
    else:
        stored = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "")
        width = 2 if stored.removeprefix("torch.") in ("bfloat16", "float16") else 4
        nbytes = shapes.linear_params * width
    return replace(shapes, weight_bytes=nbytes)


def _import_peer(key: str) -> tuple[Any, str | None]:
    """(module, None), or (None, why it cannot run)."""
    module, package = PEER_PACKAGES[key]
    try:
        return importlib.import_module(module), None
    except ImportError:
        return None, f"{package} is not installed (pip install 'mrv2[peers]')"
    except Exception as error:  # a broken install: say what, run the others
        return None, f"`import {module}` failed: {type(error).__name__}: {error}"


def plan_engines(keys: list[str], model: SweepModel,
                 bf16_precision: str) -> tuple[list[EngineSpec], list[Skip]]:
    """The engines to run, in the table's column order, and the ones left out with why."""
    gguf = f"gguf {model.gguf_type}" if model.gguf_type else "gguf"
    specs: list[EngineSpec] = []
    skips: list[Skip] = []
    for key in keys:
        if key == "mrv2:default":
            specs.append(EngineSpec(key, "mrv2", "defaults"))
        elif key == "mrv2:float32":
            specs.append(EngineSpec(key, "mrv2", "float32"))
        elif key == "mrv2:gguf":
            if model.is_gguf:
                specs.append(EngineSpec(key, "mrv2", gguf))
            else:
                skips.append(Skip("mrv2 gguf", "the model is not a GGUF file"))
        elif key == "mrv2:bf16":
            specs.append(EngineSpec(key, "mrv2", bf16_precision))
        elif key == "transformers":
            specs.append(EngineSpec(key, "transformers", "float32"))
        elif key == "llama.cpp" and not model.is_gguf:
            skips.append(Skip("llama.cpp", "it runs GGUF files, the model is a directory"))
        else:
            _, reason = _import_peer(key) if key == "llama.cpp" else vllm_peer.probe()
            if reason is not None:
                skip = Skip("llama.cpp" if key == "llama.cpp" else "vLLM", reason)
                if skip not in skips:  # vLLM's precisions share one reason
                    skips.append(skip)
            elif key == "llama.cpp":
                specs.append(EngineSpec(key, "llama.cpp", gguf))
            elif key == "vllm:bf16" and bf16_precision != "bfloat16":
                skips.append(Skip("vLLM bfloat16", "this CPU has no bfloat16 matrix "
                                  "instructions (AVX-512 BF16 or AMX): vLLM would emulate them"))
            else:
                specs.append(EngineSpec(key, "vLLM", _VLLM_DTYPES[key]))
    return specs, skips


class _OfflineLLM:
    """mrv2's LLM (vLLM's offline API): token-id prompts, greedy, EOS ignored. Its threads are
    not fitted to the free cores (free_cores.py): the sweep runs one engine at a time, so the
    fitting's "neighbour" is the sweep's other engines loading and running while this one
    idles; its first step then ran on one thread, ~30% slower after (bench/README.md)."""

    def __init__(self, spec: EngineSpec, module: Any, **kwargs: Any) -> None:
        self.spec = spec
        self._params = module.SamplingParams
        with free_cores.off_while_loading():
            self.llm = module.LLM(**kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self._params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.llm = None
        gc.collect()


class TransformersEngine:
    """transformers' `generate` on the whole batch (the prompts have one length: no padding)."""

    def __init__(self, spec: EngineSpec, model: SweepModel) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(model.hf_dir(),
                                                          dtype=torch.float32).eval()
        # Greedy only: the checkpoint's sampling defaults would just draw warnings.
        config = self.model.generation_config
        config.temperature = config.top_p = config.top_k = None
        config.do_sample = False
        eos = config.eos_token_id
        self._pad = config.pad_token_id if config.pad_token_id is not None else (
            (eos[0] if isinstance(eos, list) else eos) or 0)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        import torch

        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      do_sample=False, max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, pad_token_id=self._pad)
        return out[:, ids.shape[1]:].tolist()

    def shutdown(self) -> None:
        self.model = None
        gc.collect()


def _has_amx() -> bool:
    from mrv2.entrypoints.bench.sweep_machine import read_cpu_info

    return read_cpu_info().has("amx_int8")


class LlamaCppEngine:
    """llama.cpp on the GGUF file through llama-cpp-python's bindings of its C API, every prompt
    one sequence of a batch (as llama.cpp's own server and batched examples run them): the
    prompts' tokens prefilled in batches of `n_batch`, then one `llama_decode` a step with each
    sequence's next token, greedy (the argmax of its logits, as `temp=0` picks), no stop at
    EOS. The KV cache is cleared before each call (no prefix reuse between runs)."""

    def __init__(self, spec: EngineSpec, model: SweepModel, setup: SweepSetup) -> None:
        module, _ = _import_peer("llama.cpp")
        self.spec = spec
        # llama-cpp-python prints llama.cpp's log lines at or above its logger's level (its
        # Llama(verbose=False) sets ERROR too).
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        self._c = lib = module.llama_cpp
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # ggml's AMX matmul (an "extra" buffer type, on CPUs with AMX) segfaults in
        # llama-cpp-python 0.3.36 at the first decode (bench/README.md): its weights stay in
        # plain CPU buffers there, the configuration of llama.cpp that runs.
        model_params.use_extra_bufts = not _has_amx()
        self._model = lib.llama_model_load_from_file(model.path.encode(), model_params)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model.path}")
        params = lib.llama_context_default_params()
        params.n_seq_max = setup.max_batch
        params.n_ctx = setup.max_batch * setup.max_model_len
        params.n_batch = params.n_ubatch = LLAMA_CPP_BATCH_TOKENS
        params.n_threads = params.n_threads_batch = setup.threads
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self._vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self._batch = lib.llama_batch_init(max(LLAMA_CPP_BATCH_TOKENS, setup.max_batch), 0,
                                           setup.max_batch)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """One llama_decode of (token, position, sequence, wants logits) entries: the greedy
        next token of each sequence whose entry wants logits."""
        import numpy as np

        lib, batch = self._c, self._batch
        batch.n_tokens = len(entries)
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, position
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = logits
        if lib.llama_decode(self._ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        picks = {}
        for i, (_, _, seq, logits) in enumerate(entries):
            if logits:
                row = np.ctypeslib.as_array(lib.llama_get_logits_ith(self._ctx, i),
                                            shape=(self._vocab,))
                picks[seq] = int(row.argmax())
        return picks

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        lib = self._c
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        entries = [(token, position, seq, position == len(prompt) - 1)
                   for seq, prompt in enumerate(prompts) for position, token in enumerate(prompt)]
        outputs: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(entries), LLAMA_CPP_BATCH_TOKENS):
            for seq, token in self._decode(entries[start:start + LLAMA_CPP_BATCH_TOKENS]).items():
                outputs[seq].append(token)
        for step in range(1, max_tokens):
            picks = self._decode([(out[-1], len(prompt) + step - 1, seq, True)
                                  for seq, (prompt, out) in enumerate(zip(prompts, outputs))])
            for seq, token in picks.items():
                outputs[seq].append(token)
        return outputs

    def shutdown(self) -> None:
        lib = self._c
        if self._ctx:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._ctx)
            lib.llama_model_free(self._model)
        self._ctx = self._model = None
        gc.collect()


def _kv_cache_bytes(model: SweepModel, setup: SweepSetup) -> int:
    """The KV cache the workload needs (+25%), not each engine's default (mrv2's 4 GiB,
    vLLM's share of the machine's memory)."""
    tokens = setup.max_batch * (setup.max_model_len + 32)
    return int(1.25 * tokens * model.kv_bytes_per_token)


_VLLM_DTYPES = {"vllm:float32": "float32", "vllm:bf16": "bfloat16"}


class _VllmEngine(vllm_peer.VllmProcess):
    def __init__(self, spec: EngineSpec, **kwargs: Any) -> None:
        self.spec = spec
        super().__init__(**kwargs)


def load_engine(spec: EngineSpec, model: SweepModel, setup: SweepSetup) -> Any:
    """The loaded engine of `spec`, sized for the sweep's largest batch and context."""
    common = dict(max_model_len=setup.max_model_len, max_num_seqs=setup.max_batch,
                  seed=setup.seed, enable_prefix_caching=False)
    if spec.engine == "mrv2":
        import mrv2

        kv_gb = max(0.01, _kv_cache_bytes(model, setup) / 2**30)
        precision: dict[str, Callable[[], dict[str, Any]]] = {
            "mrv2:default": dict, "mrv2:float32": lambda: dict(dtype="float32"),
            "mrv2:gguf": lambda: dict(quantization="gguf"),
            "mrv2:bf16": lambda: dict(dtype="bfloat16")}
        tuning = {} if spec.key == "mrv2:default" else dict(
            num_scheduler_steps=setup.num_scheduler_steps, kv_cache_dtype=setup.kv_cache_dtype)
        return _OfflineLLM(spec, mrv2, model=model.path, kv_cache_memory_gb=kv_gb, **common,
                           **tuning, **precision[spec.key]())
    if spec.key == "transformers":
        return TransformersEngine(spec, model)
    if spec.key == "llama.cpp":
        return LlamaCppEngine(spec, model, setup)
    return _VllmEngine(spec, env=vllm_peer.cpu_env(setup.threads), model=model.hf_dir(),
                       dtype=_VLLM_DTYPES[spec.key],
                       kv_cache_memory_bytes=_kv_cache_bytes(model, setup), **common)


def engine_version(spec: EngineSpec) -> str | None:
    if spec.engine == "vLLM":
        return vllm_peer.probe()[0]
    module = {"mrv2": "mrv2", "transformers": "transformers", "llama.cpp": "llama_cpp"}[spec.engine]
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:  # noqa: BLE001 - a version is a nicety
        return None
