"""Worker: KV cache sizing from the memory budget, and the cache tensors it allocates."""

from __future__ import annotations

import pytest
import torch

from mrv2.config import ConfigError
from mrv2.engine.arg_utils import EngineArgs
from mrv2.worker import Worker

# tiny llama: 2 layers, 2 kv heads, head_dim 16, float32 -> one 16-token block, K and V.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def make_worker(model_dir, blocks_budget: float | None = None, **kwargs) -> Worker:
    kv_gb = None if blocks_budget is None else blocks_budget * BLOCK_BYTES / (1 << 30)
    args = dict(model=str(model_dir), max_model_len=128, max_num_seqs=4, block_size=16,
                device="cpu", kv_cache_memory_gb=kv_gb)
    args.update(kwargs)
    return Worker(EngineArgs(**args).create_engine_config())


def test_kv_block_bytes(tiny_llama):
    assert make_worker(tiny_llama).kv_block_bytes == BLOCK_BYTES


@pytest.mark.parametrize("kv_cache_dtype", ["float16"])
def test_16_bit_cache_holds_twice_the_blocks(tiny_llama, kv_cache_dtype):
    worker = make_worker(tiny_llama, 12, kv_cache_dtype=kv_cache_dtype)
    assert worker.kv_block_bytes == BLOCK_BYTES // 2
    assert worker.determine_num_kv_blocks() == 24
    worker.load_model()
    worker.initialize_kv_cache(24)
    assert all(c.dtype == getattr(torch, kv_cache_dtype) and c.shape[1] == 24
               for c in worker.runner.kv_caches)


def test_budget_sets_block_count(tiny_llama):
    # 8 blocks per 128-token request; 12 fit the budget, fewer than 4 * 8 + 1 needed.
    assert make_worker(tiny_llama, 12).determine_num_kv_blocks() == 12
    # A partial block does not count.
    assert make_worker(tiny_llama, 12.5).determine_num_kv_blocks() == 12


def test_block_count_capped_at_what_max_num_seqs_can_use(tiny_llama):
    # max_num_seqs * blocks_per_req + the null block.
    assert make_worker(tiny_llama, 1000).determine_num_kv_blocks() == 4 * 8 + 1
    assert make_worker(tiny_llama, 1000, max_num_seqs=2,
                       max_model_len=100).determine_num_kv_blocks() == 2 * 7 + 1
    # No budget given: the platform default (GiBs on CPU) is capped the same way.
    assert make_worker(tiny_llama).determine_num_kv_blocks() == 4 * 8 + 1


def test_smallest_budget_holds_one_full_request(tiny_llama):
    assert make_worker(tiny_llama, 9).determine_num_kv_blocks() == 9


def test_too_small_budget_names_max_model_len(tiny_llama):
    with pytest.raises(ConfigError, match=r"max_model_len=128") as info:
        make_worker(tiny_llama, 8).determine_num_kv_blocks()
    assert "kv_cache_memory_gb" in str(info.value)


def test_kv_caches_are_zeros_with_paged_shape(tiny_llama):
    worker = make_worker(tiny_llama, 20)
    worker.load_model()
    num_blocks = worker.determine_num_kv_blocks()
    worker.initialize_kv_cache(num_blocks)
    assert worker.num_kv_blocks == num_blocks == 20
    caches = worker.runner.kv_caches
    assert len(caches) == 2  # one per layer
    for cache in caches:
        assert cache.shape == (2, 20, 16, 2, 16)
        assert cache.dtype == torch.float32
        assert cache.device.type == "cpu"
        assert not cache.any()
    assert caches[0].data_ptr() != caches[1].data_ptr()


def test_cpu_kv_caches_sit_on_huge_pages_and_come_back_zeroed_after_sleep(tiny_llama):
    """A layer of 2 MiB or more (513 blocks of 4 KiB here) is advised onto huge pages
    (utils/huge_pages.py), at start-up and again when wake_up gives the memory back."""
    from mrv2.utils import huge_pages

    worker = make_worker(tiny_llama, 1000, max_num_seqs=64)
    worker.load_model()
    worker.initialize_kv_cache(worker.determine_num_kv_blocks())
    caches = worker.runner.kv_caches
    assert caches[0].shape == (2, 513, 16, 2, 16)
    thp = huge_pages.advised_huge(huge_pages.zeros((huge_pages.HUGE_PAGE_BYTES,), torch.uint8))
    for cache in caches:
        assert cache.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
        assert huge_pages.advised_huge(cache) == thp
        cache.fill_(1.0)
    worker.sleep(1)
    assert all(cache.numel() == 0 for cache in caches)
    worker.wake_up()
    for cache in worker.runner.kv_caches:
        assert cache.shape == (2, 513, 16, 2, 16) and not cache.any()
        assert huge_pages.advised_huge(cache) == thp


def test_the_runner_asks_the_fused_paths_of_the_model_it_runs(tiny_llama):
    """On the CPU the runner's `fused_decode` is the fast paths' FusedDecode of the worker's
    model; level-2 sleep drops it with the weights, and wake_up gives the runner the paths of
    the reloaded model (never the old model's)."""
    from mrv2.models.cpu.decode import FusedDecode

    worker = make_worker(tiny_llama, 20)
    worker.load_model()
    worker.initialize_kv_cache(20)
    fused = worker.runner.fused_decode
    assert isinstance(fused, FusedDecode) and fused.model is worker.model.model
    worker.sleep(2)
    assert worker.runner.fused_decode is None and worker.runner.model is None
    worker.wake_up()
    again = worker.runner.fused_decode
    assert isinstance(again, FusedDecode) and again is not fused
    assert again.model is worker.model.model and worker.runner.model is worker.model


def test_cpu_weights_are_collapsed_onto_huge_pages_once_each(monkeypatch):
    """Every parameter and buffer, and the q / scale tables of the weights the modules were
    given to compute on in their place (CpuFastPaths.packed), are handed to
    huge_pages.collapse; their values unchanged."""
    from mrv2.models import cpu as cpu_fast_paths
    from mrv2.models.cpu.quantized_weights import PackedModules
    from mrv2.models.layers.quantized import PackedWeight
    from mrv2.utils import huge_pages
    from mrv2.worker import _weights_onto_huge_pages

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(1024, 1024)  # 4 MiB
    model.head = torch.nn.Linear(1024, 1024, bias=False)
    model.head.weight = model.embed.weight  # tied: one memory
    model.register_buffer("table", torch.ones(8))
    half = PackedWeight("bf16", 0, torch.zeros(1024, 2048, dtype=torch.int16), None, None,
                           "BF16")
    blocks = PackedWeight("i8", 32, torch.zeros(64, 64, dtype=torch.int8),
                             torch.ones(64, 2, dtype=torch.int16), None, "Q8_0")
    paths = cpu_fast_paths.CpuFastPaths(None, PackedModules({"a": half, "b": blocks}))
    seen = []
    real = huge_pages.collapse
    monkeypatch.setattr(huge_pages, "collapse", lambda ts: seen.extend(ts) or real(ts))
    monkeypatch.setenv(huge_pages.WEIGHTS_ENV, "0")  # the suite's setting: nothing collapsed
    _weights_onto_huge_pages(model, paths)
    assert seen == []
    monkeypatch.setenv(huge_pages.WEIGHTS_ENV, "1")
    _weights_onto_huge_pages(model, paths)
    addresses = {huge_pages.memory_of(t)[0] for t in seen}
    assert addresses == {model.embed.weight.data_ptr(), model.table.data_ptr(),
                         half.q.data_ptr(), blocks.q.data_ptr(), blocks.scales.data_ptr()}
    assert torch.equal(half.q, torch.zeros_like(half.q))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kv_budget_leaves_room_for_the_largest_step(tiny_llama):
    """The profile run measures a positive peak, and the KV cache sized after it still lets
    the largest step run (the whole budget minus that peak)."""
    worker = make_worker(tiny_llama, device="cuda", max_num_seqs=8)
    worker.load_model()
    assert worker.profile_run() > 0
    num_blocks = worker.determine_num_kv_blocks()
    worker.initialize_kv_cache(num_blocks)
    worker.runner.profile_run()  # the largest step, on the real cache: no out-of-memory
