"""Worker: one device's model, KV cache and runner.

Start-up order: device -> distributed group -> model weights -> KV cache size -> KV cache
tensors -> runner.

Under tensor parallelism there is one worker per rank (`rank`, `local_rank` = its device index
on CUDA); each joins the group at `distributed_init_method` when it loads the model, holds its
shard of the weights and a KV cache of its own kv heads only, and runs every step: the logits
are all-gathered, so every rank samples the same tokens and its runner state stays in step.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
from typing import TYPE_CHECKING

import numba
import torch

from executor.deferred import Deferred
from mrv2 import batch_invariant, distributed, platform
from mrv2.async_output import AsyncOutput
from mrv2.attention.backend import attach_split_kv_scratch, kv_cache_shape
from mrv2.config import ConfigError, EngineConfig, ModelConfig
from mrv2.core.kv_cache_layout import layer_kv_shape, recurrent_state_shapes
from mrv2.models import cpu as cpu_fast_paths
from mrv2.models.loader import load_model
from mrv2.pipeline import stage_layers
from mrv2.protocol import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from mrv2.runner import ModelRunner
from mrv2.spec_decode.draft_model import (DraftModel, draft_kv_block_bytes, draft_kv_caches,
                                          load_draft_model)
from mrv2.utils import free_cores, huge_pages

if TYPE_CHECKING:
    from mrv2.models.cpu.decode import FusedDecode

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int | None = None,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.tp_size = parallel.tensor_parallel_size
        # This rank's pipeline stage's layers (all of them without stages).
        self.held_layers = stage_layers(config.model_config.num_layers, rank // self.tp_size,
                                        parallel.pipeline_parallel_size)
        self.distributed_init_method = distributed_init_method
        if not 0 <= rank < self.world_size:
            raise ValueError(f"worker rank {rank} is outside a world of {self.world_size}")
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.world_size > 1:
            self.device = torch.device("cuda", self.local_rank)
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.num_kv_blocks = 0
        self._kv_asleep = False  # the KV caches' storage was given back (sleep mode)
        self._fast_paths: cpu_fast_paths.CpuFastPaths | None = None
        # speculative method "draft_model": the draft and its fused decode paths
        self._draft: tuple[torch.nn.Module, FusedDecode | None] | None = None
        self._free_cores: free_cores.FreeCoreThreads | None = None

    @staticmethod
    def process_env(ranks_on_node: int, node_cores: int | None = None) -> dict[str, str]:
        """The environment a rank's process starts with when `ranks_on_node` ranks share its
        machine (`node_cores`: that machine's cores, when it is not this one): each its share
        of the cores in numba's and OpenMP's pools, sized as they load. Executors call it
        (they start the processes and know where ranks land)."""
        return free_cores.pool_env(ranks_on_node, node_cores)

    def load_model(self) -> None:
        if self.device.type == "cpu":
            # Ranks of several (world_size > 1) started with their share of the cores
            # (process_env); one rank alone fits its threads to the cores others leave free.
            if self.world_size == 1 and free_cores.enabled():
                self._free_cores = free_cores.FreeCoreThreads(numba.get_num_threads())
        elif self.device.index is not None:  # a CUDA rank: its own device
            torch.cuda.set_device(self.device)
        distributed.init_distributed(
            self.rank, self.world_size, self.distributed_init_method, self.device,
            expert_parallel=self.config.parallel_config.enable_expert_parallel,
            pipeline_parallel_size=self.config.parallel_config.pipeline_parallel_size)
        self._load_weights()

    def _load_weights(self) -> None:
        # Before the weights: their kernel plans are made as they load.
        batch_invariant.set_active(self.config.model_config.batch_invariant)
        self.model = load_model(self.config.model_config, self.device)
        if self.device.type == "cpu":
            self._fast_paths = cpu_fast_paths.prepare(self.model, self.config.model_config)
            _weights_onto_huge_pages(self.model, self._fast_paths)
        elif self.device.type == "cuda":
            # Decode-only steps split long contexts over several programs (flash-decoding);
            # the partials' scratch is allocated once here, before warm-up and graph capture.
            attach_split_kv_scratch(self.model, self.config.scheduler_config.max_num_seqs,
                                    self.config.model_config.max_model_len, self.device)
        draft_config = self._draft_config
        if draft_config is not None and self._draft is None:  # sleep level 2 keeps it
            self._draft = load_draft_model(draft_config, self.device,
                                           self.config.speculative_config.method)

    @property
    def _draft_config(self) -> ModelConfig | None:
        spec = self.config.speculative_config
        return None if spec is None else spec.draft_model_config

    def _layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads this rank caches, head dim) of a layer (its share under tensor
        parallelism)."""
        kv_heads, head_dim = layer_kv_shape(self.config.model_config.hf_config, layer)
        return kv_heads // self.tp_size, head_dim

    @property
    def _kv_width(self) -> int:
        """Elements per token of each KV tensor, K or V: the widest layer's."""
        return max(kv_heads * head_dim for kv_heads, head_dim in
                   map(self._layer_kv_shape, range(self.config.model_config.num_layers)))

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block id: a block of each KV tensor (one per layer, or per position in
        a group of a hybrid layout: core/kv_cache_layout.py)."""
        cc = self.config.cache_config
        elem = self.config.kv_cache_dtype.itemsize
        num_tensors = len(self._held_kv_tensors)
        draft = (0 if self._draft_config is None  # a draft model's blocks share the ids
                 else draft_kv_block_bytes(self._draft_config, cc.block_size,
                                           self.config.kv_cache_dtype))
        return 2 * num_tensors * cc.block_size * self._kv_width * elem + draft

    def determine_num_kv_blocks(self) -> int:
        """Blocks that fit the KV budget, capped at what max_num_seqs full-length requests use.

        Block 0 is the null block, so one extra block is always allocated.
        """
        cc = self.config.cache_config
        if cc.kv_cache_memory_gb is not None:
            budget = int(cc.kv_cache_memory_gb * (1 << 30))
        else:
            # On CUDA the budget is what stays free after the largest step's peak; the CPU's
            # is a fixed size (platform.default_kv_cache_bytes).
            peak = self.profile_run() if self.device.type == "cuda" else 0
            budget = platform.default_kv_cache_bytes(self.device,
                                                     cc.gpu_memory_utilization) - peak
        budget -= self.recurrent_state_bytes
        fit = max(budget, 0) // self.kv_block_bytes
        per_request = self.config.model_config.kv_cache_layout.max_blocks_per_request(
            self.config.model_config.max_model_len, cc.block_size,
            self.config.max_kv_tokens_per_step)
        num_blocks = min(fit, self.config.scheduler_config.max_num_seqs * per_request + 1)
        min_blocks = per_request + 1
        if num_blocks < min_blocks:
            raise ConfigError(
                f"the KV cache budget of {budget / (1 << 30):.3f} GiB holds {fit} blocks of "
                f"{self.config.cache_config.block_size} tokens, but one request of "
                f"max_model_len={self.config.model_config.max_model_len} needs {min_blocks - 1}; "
                f"raise kv_cache_memory_gb or lower max_model_len")
        return int(num_blocks)

    @property
    def recurrent_state_bytes(self) -> int:
        """Bytes of the recurrent states of this rank's recurrent layers (a hybrid model's
        linear-attention layers), each slot's, float32: taken from the KV budget first."""
        mc = self.config.model_config
        layers = [layer for layer in mc.kv_cache_layout.recurrent if layer in self.held_layers]
        return (4 * len(layers) * self.config.scheduler_config.max_num_seqs
                * self._state_floats_per_slot) if layers else 0

    @property
    def _state_floats_per_slot(self) -> int:
        conv, delta = recurrent_state_shapes(self.config.model_config.hf_config, self.tp_size)
        return math.prod(conv) + math.prod(delta)

    def profile_run(self) -> int:
        """Bytes the largest step takes beyond what is allocated now (CUDA): a throwaway runner
        over a one-block KV cache runs `ModelRunner.profile_run`, so step temporaries and the
        largest sampler tables are reserved before the KV cache takes the rest."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        caches = self._kv_caches(1)
        ModelRunner(self.config, self.model, caches, self.device).profile_run()
        if not cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # the throwaway runner's memory goes back before sizing
        return peak

    def _kv_cache_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's KV cache. Zeros, not empty: masked-out keys and values must never be NaN
        (0 * NaN = NaN). On the CPU on huge pages (utils/huge_pages.py: the blocks a step reads
        lie scattered over the cache)."""
        if self.device.type == "cpu":
            return huge_pages.zeros(shape, self.config.kv_cache_dtype)
        return torch.zeros(shape, dtype=self.config.kv_cache_dtype, device=self.device)

    def _kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """Each layer's KV cache [2, blocks, block_size, kv heads, head dim]: a view of the
        layout's tensor that its position in its KV cache group names, with `block_scale`
        blocks of its shape per block id (core/kv_cache_layout.py). The layers of one tensor
        and shape share one view object; a KV-shared layer gets its source's."""
        mc, cc = self.config.model_config, self.config.cache_config
        layout = mc.kv_cache_layout
        tensors = {i: self._kv_cache_zeros((2, num_blocks, cc.block_size * self._kv_width))
                   for i in self._held_kv_tensors}
        views: dict[tuple[int, int, int, int], torch.Tensor] = {}
        caches = []
        for layer in range(mc.num_layers):
            if layer not in self.held_layers:  # another pipeline stage's: no cache here
                caches.append(torch.empty(0, dtype=self.config.kv_cache_dtype,
                                          device=self.device))
                continue
            if layer in layout.recurrent:  # every slot's state, flat (the layer views it)
                caches.append(torch.zeros(self.config.scheduler_config.max_num_seqs
                                          * self._state_floats_per_slot, dtype=torch.float32,
                                          device=self.device))
                continue
            source = layout.layer_source[layer]
            kv_heads, head_dim = self._layer_kv_shape(source)
            scale = layout.groups[layout.layer_group[source]].block_scale
            key = (layout.layer_tensor[source], scale, kv_heads, head_dim)
            if key not in views:
                # On the tensor's storage, not a `.view` of it: a view would keep the tensor
                # (its `_base`) and so the memory alive through `sleep`'s `set_`.
                tensor = tensors[key[0]]
                views[key] = tensor.new_empty(0).set_(
                    tensor.untyped_storage(), tensor.storage_offset(),
                    kv_cache_shape(num_blocks * scale, cc.block_size, kv_heads, head_dim))
            caches.append(views[key])
        return caches

    @property
    def _held_kv_tensors(self) -> list[int]:
        """The layout's KV tensors this rank's layers use (all of them without stages)."""
        layout = self.config.model_config.kv_cache_layout
        return sorted({layout.layer_tensor[layout.layer_source[layer]]
                       for layer in self.held_layers if layer not in layout.recurrent})

    def _kv_tensors(self) -> list[torch.Tensor]:
        """The runner's KV cache views, each once (a draft model's included)."""
        caches = [*self.runner.kv_caches, *self._draft_kv_caches()]
        return list({id(cache): cache for cache in caches}.values())

    def _draft_kv_caches(self) -> list[torch.Tensor]:
        return [] if self.runner.speculator is None else self.runner.speculator.draft_kv_caches

    def _new_draft(self, num_blocks: int) -> DraftModel | None:
        """The runner's draft model (method "draft_model"), with new KV caches."""
        if self._draft is None:
            return None
        caches = draft_kv_caches(self._draft_config, num_blocks,
                                 self.config.cache_config.block_size, self.config.kv_cache_dtype)
        return DraftModel(*self._draft, caches)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        cc = self.config.cache_config
        kv_caches = self._kv_caches(num_blocks)
        self.num_kv_blocks = num_blocks
        self.runner = ModelRunner(self.config, self.model, kv_caches, self.device,
                                  draft=self._new_draft(num_blocks))
        self.runner.fused_decode = self._fused_decode()
        self.runner.capture_model()
        self.runner.warm_up()
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, cc.block_size,
                    num_blocks * self.kv_block_bytes / (1 << 20))

    def _fused_decode(self):
        """The runner's `fused_decode`: the CPU's fused decode paths of this model, if any."""
        return None if self._fast_paths is None else self._fast_paths.decode

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode, for an idle engine. Level 1 discards the KV cache's memory (the
        runner's cache tensors stay the same objects, with empty storage); level 2 also
        drops the weights. On the CPU the weights already live in host memory, so level 1
        moves nothing there (on CUDA too: mrv2 does not offload them)."""
        if not self._kv_asleep:
            if self._fast_paths is not None:
                self._fast_paths.release_kv_views()
            if self._draft is not None and self._draft[1] is not None:
                self._draft[1].release_kv_views()
            self._kv_asleep = True
            for cache in self._kv_tensors():
                cache.set_(cache.new_empty(0))  # the old storage goes with its last view
        if level == 2:
            self.model = self.runner.model = self._fast_paths = self.runner.fused_decode = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _return_free_heap_pages()

    def wake_up(self) -> None:
        """Give the KV cache its memory back (zeroed, as at start-up) and, after level 2, load
        the weights again from the checkpoint (vLLM leaves that to the user)."""
        if self._kv_asleep:
            # New tensors viewed as before; each layer's cache object takes its new view.
            for cache, fresh in zip(self.runner.kv_caches, self._kv_caches(self.num_kv_blocks)):
                cache.set_(fresh)
            draft = self._new_draft(self.num_kv_blocks)
            for cache, fresh in zip(self._draft_kv_caches(), [] if draft is None
                                    else draft.kv_caches):
                cache.set_(fresh)
            self._kv_asleep = False
        if self.model is None:
            self._load_weights()
            self.runner.model, self.runner.fused_decode = self.model, self._fused_decode()
            self.runner.capture_model()  # graphs read the old weights' addresses

    def close(self) -> None:
        """Leave the tensor-parallel group (the worker process calls it on its way out)."""
        distributed.destroy_distributed()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self._free_cores is not None:
            free_cores.fit_kernel_threads(self._free_cores)
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None
                      ) -> ModelRunnerOutput | Deferred[ModelRunnerOutput]:
        """Phase 2. With a copy in flight (CUDA) it returns the AsyncOutput at once: the
        executor resolves it while this worker already runs the next step's phase 1. An
        output that is ready (CPU) goes back directly: a thread hop would only cost."""
        if self._free_cores is not None:
            free_cores.fit_kernel_threads(self._free_cores)
        output = self.runner.sample_tokens_async(grammar_output)
        if isinstance(output, AsyncOutput) and not output.copy_in_flight:
            return output.get_output()
        return output


def _weights_onto_huge_pages(model: torch.nn.Module,
                             fast_paths: cpu_fast_paths.CpuFastPaths | None) -> None:
    """Move every weight a CPU decode step streams onto huge pages (huge_pages.collapse_weights):
    the model's parameters and buffers, and the quantized or 16-bit weights the fast paths
    compute on in their place. oneDNN's packed copies are collapsed where they are made."""
    tensors = [*model.parameters(), *model.buffers()]
    if fast_paths is not None and fast_paths.packed is not None:
        tensors += [t for weight in fast_paths.packed.all_weights()
                    for t in weight.storage_tensors()]
    huge_pages.collapse_weights(tensors)


def _return_free_heap_pages() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). A large block
    (a KV cache layer) is usually its own mapping, unmapped when freed, but glibc serves it
    from the heap when enough freed, coalesced memory lies there, and freeing it then keeps
    the pages resident. Elsewhere than glibc: nothing to do."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
