"""Tensor-parallel building blocks without an engine (ParallelConfig's checks are in
tests/test_parallel_config.py): the sharded
loaders (which rows/columns each rank reads, from tensors and from lazy safetensors slices),
per-rank partial results that combine into the unsharded layer's output, a whole model loaded
as rank 0 and rank 1, and the gloo collectives across two real processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mrv2 import distributed
from mrv2.models.layers.linear import (ColumnParallelLinear, Linear, MergedLinear, QKVLinear,
                                       RowParallelLinear)
from mrv2.models.layers.vocab_embedding import (ParallelLMHead, VocabParallelEmbedding,
                                                parallel_logits, vocab_range)

TP = 2


@pytest.fixture
def no_collectives(monkeypatch):
    """Collectives as identity: each rank's forward returns its partial result."""
    monkeypatch.setattr(distributed, "tp_all_reduce", lambda x: x)
    monkeypatch.setattr(distributed, "tp_all_gather", lambda x, dim=-1: x)


# -- sharded layers --------------------------------------------------------------------------------

def test_qkv_shard_ranges_and_heads():
    H, KV, D, hidden = 4, 2, 3, 8
    wq = torch.randn(H * D, hidden)
    wk, wv = torch.randn(KV * D, hidden), torch.randn(KV * D, hidden)
    bq, bk, bv = torch.randn(H * D), torch.randn(KV * D), torch.randn(KV * D)
    full = QKVLinear(hidden, D, H, KV, bias=True, tp_rank=0, tp_size=1)
    x = torch.randn(5, hidden)
    parts = []
    for rank in range(TP):
        layer = QKVLinear(hidden, D, H, KV, bias=True, tp_rank=rank, tp_size=TP)
        assert (layer.num_heads, layer.num_kv_heads) == (H // TP, KV // TP)
        assert layer.weight.shape == ((H + 2 * KV) * D // TP, hidden)
        # This rank's parameter: q rows [0, 6), k rows [6, 9), v rows [9, 12).
        assert [layer.shard_range(s) for s in "qkv"] == [(0, 6), (6, 3), (9, 3)]
        # ... read from rows [rank*6, +6) of q_proj and [rank*3, +3) of k_proj / v_proj.
        assert layer.checkpoint_shard_range("q") == (rank * 6, 6)
        assert layer.checkpoint_shard_range("v") == (rank * 3, 3)
        for sid, w, b in (("k", wk, bk), ("v", wv, bv), ("q", wq, bq)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q, k, v = layer.forward_split(x)
        assert torch.equal(layer.weight[:6], wq[rank * 6:rank * 6 + 6])
        assert torch.equal(layer.weight[6:9], wk[rank * 3:rank * 3 + 3])
        parts.append((q, k, v))
    for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        full.weight.weight_loader(full.weight, w, sid)
        full.bias.weight_loader(full.bias, b, sid)
    for i, want in enumerate(full.forward_split(x)):
        torch.testing.assert_close(torch.cat([p[i] for p in parts], dim=-1), want)
    with pytest.raises(ValueError, match="shard 'k'.*shape"):
        layer.weight.weight_loader(layer.weight, torch.randn(KV * D // TP, hidden), "k")


def test_fused_checkpoint_tensor_is_split_per_shard():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    for rank in range(TP):
        layer = MergedLinear(4, [6, 6], tp_rank=rank, tp_size=TP)
        assert layer.output_sizes == [3, 3]
        layer.weight.weight_loader(layer.weight, torch.cat([gate, up]), None)
        want = torch.cat([gate[rank * 3:rank * 3 + 3], up[rank * 3:rank * 3 + 3]])
        assert torch.equal(layer.weight, want)


def test_column_and_row_parallel_combine(no_collectives):
    x = torch.randn(3, 8)
    w1, w2, b2 = torch.randn(12, 8), torch.randn(5, 12), torch.randn(5)
    ref1, ref2 = Linear(8, 12), Linear(12, 5, bias=True)
    ref1.weight.weight_loader(ref1.weight, w1)
    ref2.weight.weight_loader(ref2.weight, w2)
    ref2.bias.weight_loader(ref2.bias, b2)
    partials = []
    for rank in range(TP):
        col = ColumnParallelLinear(8, 12, tp_rank=rank, tp_size=TP)
        row = RowParallelLinear(12, 5, bias=True, tp_rank=rank, tp_size=TP)
        col.weight.weight_loader(col.weight, w1)
        row.weight.weight_loader(row.weight, w2)
        row.bias.weight_loader(row.bias, b2)
        assert torch.equal(row.weight, w2[:, rank * 6:rank * 6 + 6])
        partials.append(row(col(x)))
    # all_reduce sums the partials; with identity collectives each adds the bias itself.
    torch.testing.assert_close(sum(partials) - (TP - 1) * b2, ref2(ref1(x)))
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=2"):
        ColumnParallelLinear(8, 5, tp_rank=0, tp_size=TP)


@pytest.mark.parametrize("vocab, tp", [(10, 2), (10, 4), (7, 3)])
def test_vocab_parallel_embedding_and_lm_head(no_collectives, vocab, tp):
    table = torch.randn(vocab, 6)
    ids = torch.arange(vocab).flip(0)
    hidden = torch.randn(4, 6)
    covered, looked_up, logits = [], 0, []
    for rank in range(tp):
        start, rows, padded = vocab_range(vocab, rank, tp)
        covered.extend(range(start, start + rows))
        emb = VocabParallelEmbedding(vocab, 6, tp_rank=rank, tp_size=tp)
        head = ParallelLMHead(vocab, 6, tp_rank=rank, tp_size=tp)
        for layer in (emb, head):
            layer.weight.weight_loader(layer.weight, table)
            assert layer.weight.shape == (padded, 6)
            assert not layer.weight[rows:].any()  # padding rows are zero
        looked_up = looked_up + emb(ids)
        logits.append(torch.nn.functional.linear(hidden, head.weight))
    assert covered == list(range(vocab))  # every row on exactly one rank
    torch.testing.assert_close(looked_up, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ table.T)
    single = ParallelLMHead(vocab, 6, tp_rank=0, tp_size=1)
    single.weight.weight_loader(single.weight, table)
    assert torch.equal(parallel_logits(hidden, single), (hidden @ table.T).float())


def test_lazy_safetensors_slices_read_the_same_shards(tmp_path):
    w_q, w_o = torch.randn(8, 4), torch.randn(4, 8)
    save_file({"q": w_q, "o": w_o, "emb": torch.randn(10, 4)}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for rank in range(TP):
            eager = QKVLinear(4, 2, 4, 2, tp_rank=rank, tp_size=TP)
            lazy = QKVLinear(4, 2, 4, 2, tp_rank=rank, tp_size=TP)
            eager.weight.weight_loader(eager.weight, w_q, "q")
            lazy.weight.weight_loader(lazy.weight, f.get_slice("q"), "q")
            assert torch.equal(eager.weight[:4], lazy.weight[:4])
            row = RowParallelLinear(8, 4, tp_rank=rank, tp_size=TP)
            row.weight.weight_loader(row.weight, f.get_slice("o"))
            assert torch.equal(row.weight, w_o[:, rank * 4:rank * 4 + 4])
            emb = VocabParallelEmbedding(10, 4, tp_rank=rank, tp_size=TP)
            emb.weight.weight_loader(emb.weight, f.get_slice("emb"))
            assert torch.equal(emb.weight, f.get_tensor("emb")[rank * 5:rank * 5 + 5])
        with pytest.raises(ValueError, match="shape"):
            row.weight.weight_loader(row.weight, f.get_slice("q"))


def test_model_loaded_per_rank_holds_its_shards(tiny_model_factory, monkeypatch):
    from mrv2.config import ModelConfig
    from mrv2.models.loader import load_hf_config, load_model

    path = tiny_model_factory("qwen2", num_heads=4, num_kv_heads=2)
    mc = ModelConfig(model=str(path), dtype=torch.float32, max_model_len=64,
                     hf_config=load_hf_config(str(path)))
    full = dict(load_model(mc, torch.device("cpu")).named_parameters())
    for rank in range(TP):
        monkeypatch.setattr(distributed, "_TP_RANK", rank)
        monkeypatch.setattr(distributed, "_TP_SIZE", TP)
        model = load_model(mc, torch.device("cpu"))
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_kv_heads) == (2, 1, 1)
        params = dict(model.named_parameters())
        assert params.keys() == full.keys()
        for name, param in params.items():
            want = full[name]
            if "o_proj.weight" in name or "down_proj.weight" in name:  # row-parallel
                n = want.shape[1] // TP
                want = want[:, rank * n:(rank + 1) * n]
            elif "qkv_proj" in name:
                q, kv = 4 * mc.head_dim, 2 * mc.head_dim
                parts = want.split([q, kv, kv])
                want = torch.cat([p.chunk(TP)[rank] for p in parts])
            elif "gate_up_proj" in name:
                want = torch.cat([p.chunk(TP)[rank] for p in want.chunk(2)])
            elif "embed_tokens" in name or "lm_head" in name:
                want = want.chunk(TP)[rank]
            assert torch.equal(param, want), name


# -- real collectives over gloo --------------------------------------------------------------------

def _collectives_rank(rank: int, world: int, init_method: str, queue) -> None:
    try:
        distributed.init_distributed(rank, world, init_method, torch.device("cpu"))
        assert (distributed.get_tp_rank(), distributed.get_tp_size()) == (rank, world)
        summed = distributed.tp_all_reduce(torch.full((2, 3), float(rank + 1)))
        gathered = distributed.tp_all_gather(torch.full((2, 1), float(rank)), dim=-1)
        distributed.destroy_distributed()
        queue.put((rank, summed.tolist(), gathered.tolist()))
    except BaseException as e:  # reported, not swallowed
        queue.put((rank, repr(e), None))


def test_gloo_all_reduce_and_all_gather():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = distributed.distributed_init_method()
    procs = [ctx.Process(target=_collectives_rank, args=(r, TP, init, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, summed, gathered in results:
        assert summed == [[3.0] * 3] * 2, (rank, summed)
        assert gathered == [[0.0, 1.0]] * 2, (rank, gathered)


def test_single_rank_needs_no_group():
    distributed.init_distributed(0, 1, None, torch.device("cpu"))
    x = torch.ones(2)
    assert distributed.tp_all_reduce(x) is x and distributed.tp_all_gather(x) is x
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="rank 2 is outside"):
        distributed.init_distributed(2, 2, "tcp://127.0.0.1:1", torch.device("cpu"))
