"""Batch-invariant mode on the Triton kernels (the CUDA path), under the interpreter on CPU
tensors: a tiny Llama's logits for one request are bit-identical whether its prompt is
prefilled alone in one step, in chunks beside other requests' prefills, or partly prefilled
and then decoded token by token among other decode and prefill rows at other places in the
batch (linears and LM head on matmul_triton, attention on paged_triton with one tile size,
norms, rotary and activations on their Triton twins)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mrv2 import batch_invariant, platform
from mrv2.attention import AttentionMetadata, paged_triton
from mrv2.config import ModelConfig
from mrv2.models import load_hf_config, load_model
from mrv2.models.layers import matmul_triton

BLOCK = 4
TARGET_LEN = 11


def _forward(model, num_layers: int, kv_heads: int, head_dim: int, caches: list | None,
             rows: list[tuple[torch.Tensor, int, int, list[int]]]):
    """One step; rows = (prompt, first position, tokens this step, block table). Returns each
    row's float32 logits and the KV caches (new ones when `caches` is None)."""
    if caches is None:
        caches = [torch.zeros(2, 64, BLOCK, kv_heads, head_dim) for _ in range(num_layers)]
    width = max(len(table) for *_, table in rows)
    tables = torch.tensor([table + [0] * (width - len(table)) for *_, table in rows],
                          dtype=torch.int32)
    positions = torch.cat([torch.arange(start, start + n) for _, start, n, _ in rows])
    row_of = torch.cat([torch.full((n,), i) for i, (_, _, n, _) in enumerate(rows)])
    slots = tables[row_of, positions // BLOCK].long() * BLOCK + positions % BLOCK
    counts = [n for _, _, n, _ in rows]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lens = np.array([start + n for _, start, n, _ in rows], dtype=np.int32)
    decodes = next((i for i, n in enumerate(counts) if n != 1), len(rows))
    meta = AttentionMetadata(
        num_actual_tokens=int(starts[-1]), num_reqs=len(rows), num_decodes=decodes,
        query_start_loc=torch.from_numpy(starts), seq_lens=torch.from_numpy(lens),
        block_tables=tables, slot_mapping=slots, query_start_loc_np=starts,
        seq_lens_np=lens, max_seq_len=int(lens.max()))
    ids = torch.cat([prompt[start:start + n] for prompt, start, n, _ in rows])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, caches, meta))
    assert logits.dtype == torch.float32
    return list(logits.split(counts)), caches


@pytest.mark.usefixtures("row_invariant_interpreter_dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_requests_logits_do_not_depend_on_its_batch_on_triton(dtype, tiny_model_factory,
                                                                monkeypatch):
    # On CPU tensors the default mode's CPU linears happen to be row-invariant at these shapes
    # too, so the test also checks that the mode's Triton kernels did the work.
    matmuls, attention_calls = [], []

    def spy(owner, name, calls):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(k) or real(*a, **k))

    spy(matmul_triton, "invariant_linear", matmuls)
    spy(paged_triton, "paged_attention", attention_calls)
    path = tiny_model_factory("llama")
    hf = load_hf_config(str(path))
    mc = ModelConfig(model=str(path), dtype=dtype, max_model_len=64, hf_config=hf)
    gen = torch.Generator().manual_seed(5)
    target, *others = (torch.randint(0, hf.vocab_size, (n,), generator=gen)
                       for n in (TARGET_LEN, 7, 13, 5))
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10]]  # target, then the others
    try:
        batch_invariant.set_active(True)
        with platform.triton_interpreter():
            model = load_model(mc, torch.device("cpu"))
            shape = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
            alone = _forward(model, *shape, None, [(target, 0, TARGET_LEN, tables[0])])[0][0]
            # Chunks of 5 and 6 tokens beside other requests' prefills.
            first, caches = _forward(model, *shape, None, [
                (others[0], 0, 7, tables[1]), (target, 0, 5, tables[0])])
            second, _ = _forward(model, *shape, caches, [
                (target, 5, 6, tables[0]), (others[1], 0, 13, tables[2])])
            chunked = torch.cat([first[1], second[0]])
            # 8 tokens prefilled, then decoded one by one among decode and prefill rows.
            outs, caches = _forward(model, *shape, None, [
                (others[0], 0, 6, tables[1]), (target, 0, 8, tables[0]),
                (others[2], 0, 4, tables[3])])
            decoded = [outs[1]]
            for step, pos in enumerate(range(8, TARGET_LEN)):
                rows = [(others[0], 6, 1, tables[1]), (others[2], 4, 1, tables[3])]
                rows.insert(step % 3, (target, pos, 1, tables[0]))
                if step < 2:  # the last step decodes only
                    rows.append((others[1], 0, 3 + step, tables[2]))  # prefilled again
                outs, caches = _forward(model, *shape, caches, rows)
                decoded.append(outs[step % 3])
    finally:
        batch_invariant.set_active(False)
    assert alone.shape == (TARGET_LEN, hf.vocab_size)
    assert any(call.get("out_dtype") == torch.float32 for call in matmuls)  # the LM head
    assert len(matmuls) > 7 * mc.num_layers
    assert attention_calls and not any(call["uniform_decode"] for call in attention_calls)
    assert torch.equal(chunked, alone)
    assert torch.equal(torch.cat(decoded), alone)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_on_cuda(dtype, tiny_llama, tmp_path):
    """The engine on the GPU (compiled kernels, CUDA graphs): the CPU test's cases
    (tests/test_batch_invariant.py: alone, among 1..31 others, prefix-cache hit, chunks)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "cases.json"
    helper = Path(__file__).with_name("batch_invariant_helpers.py")
    subprocess.run([sys.executable, str(helper), str(out), str(tiny_llama), dtype, "none", "1"],
                   check=True, timeout=600)
    cases = json.loads(out.read_text())
    alone = cases.pop("alone")
    for name, case in cases.items():
        assert case == alone, name
