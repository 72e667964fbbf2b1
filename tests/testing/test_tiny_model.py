"""mrv2.testing: tiny HF models and the local tokenizer load in transformers and are reproducible."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mrv2.core.kv_cache_layout import layer_kv_shape
from mrv2.testing import (SUPPORTED_ARCHS, default_demo_model_path, get_tokenizer_dir,
                          make_tiny_model)
from mrv2.testing import tiny_model as tm
from mrv2.testing import tokenizer as tk

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
TEXTS = ["héllo wörld 你好 🙂", "  two leading spaces\n\ttab  ", "def f(x):\n    return x ** 2",
         "\x00\x7f\u200b\ufeff", "Ωμέγα — ½ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", ""]


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir for this module: the tokenizer is trained once here, not per test."""
    root = tmp_path_factory.mktemp("mrv2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MRV2_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in SUPPORTED_ARCHS}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_arch_loads_in_transformers(models: dict[str, Path], arch: str) -> None:
    d = models[arch]
    tok = AutoTokenizer.from_pretrained(d)
    config = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    assert config["architectures"] == [tm._ARCHS[arch][1]]
    assert config["vocab_size"] == 2048 and len(tok) == 2048
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(tok, key) is not None
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    # qwen3 would default to 128; Gemma 4's is per layer (the windowed layers' here)
    assert layer_kv_shape(AutoConfig.from_pretrained(d), 0)[1] == 16
    # transformers 5 loads qwen2 dirs with Qwen2Tokenizer, which rebuilds the pipeline: the raw
    # tokenizer.json must still agree with AutoTokenizer (and no extra unk token may appear).
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    logits = _logits(d, tok.encode("def main():\n    print('hi')"))
    assert torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.5
    top2 = logits.topk(2, -1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4  # greedy comparisons need no near-ties


def test_arch_specific_weights(models: dict[str, Path]) -> None:
    qwen2, qwen3 = _tensors(models["qwen2"]), _tensors(models["qwen3"])
    for proj in ("q", "k", "v"):
        assert qwen2[f"model.layers.0.self_attn.{proj}_proj.bias"].abs().min() > 0
    for name in ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                 "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        w = qwen3[name]
        assert (w - 1).abs().max() > 0.05 and (w - 1).abs().mean() < 0.3  # random around 1
    assert AutoConfig.from_pretrained(models["mistral"]).sliding_window is None


def test_seed_determinism(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen2", seed=3)
    b = make_tiny_model(tmp_path / "b", "qwen2", seed=3)
    c = make_tiny_model(tmp_path / "c", "qwen2", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ta, tc = _tensors(a), _tensors(c)
    assert all(not torch.equal(ta[k], tc[k]) for k in ta)


def test_rng_state_untouched(tmp_path: Path) -> None:
    before = torch.get_rng_state()
    make_tiny_model(tmp_path / "m", "llama", seed=9)
    assert torch.equal(before, torch.get_rng_state())


def test_sharded(tmp_path: Path, models: dict[str, Path]) -> None:
    d = make_tiny_model(tmp_path / "sharded", "llama", num_shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shards
    assert not (d / "model.safetensors").exists()
    single = _tensors(models["llama"])
    sharded = _tensors(d)
    assert single.keys() == sharded.keys() == index["weight_map"].keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    ids = [0, 5, 77, 300, 1999]
    assert torch.equal(_logits(d, ids), _logits(models["llama"], ids))


def test_split_shards_exact_count() -> None:
    for sizes, n in (([100, 1, 1, 1], 4), ([100, 1, 1, 1], 2), ([1] * 10, 3), ([5, 5], 1)):
        idx = tm._split_shards(sizes, n)
        assert sorted(set(idx)) == list(range(n)) and idx == sorted(idx)


def test_tied_embeddings(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "tied", "qwen3", tie_word_embeddings=True)
    assert "lm_head.weight" not in _tensors(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    logits = _logits(d, [0, 10, 20, 30])
    assert torch.isfinite(logits).all() and logits.std(-1).min() > 0.5


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, mistral, ministral3, qwen2, qwen3"):
        make_tiny_model(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "x", "llama", vocab_size=1000)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model(tmp_path / "foreign", "llama")
    (tmp_path / "empty").mkdir()  # an empty dir (e.g. pytest's tmp_path) is fine to fill
    assert (make_tiny_model(tmp_path / "empty", "llama") / tm.MANIFEST).is_file()


def test_rope_scaling_round_trips(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "rope", "llama", rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                        vocab_size=2100)
    saved = json.loads((d / "config.json").read_text())
    # transformers 5 stores scaling and theta together under rope_parameters.
    assert saved["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    assert "rope_scaling" not in saved and "rope_theta" not in saved
    assert AutoConfig.from_pretrained(d).rope_parameters == saved["rope_parameters"]
    logits = _logits(d, list(range(5, 300)))  # runs past original_max_position_embeddings
    assert logits.shape == (295, 2100) and torch.isfinite(logits).all()


def test_model_cache_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_tiny_model(tmp_path / "m", "mistral")
    mtime = (d / "model.safetensors").stat().st_mtime_ns

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt a model that was already complete")

    with monkeypatch.context() as mp:
        mp.setattr(tm, "_build", no_build)
        assert make_tiny_model(tmp_path / "m", "mistral") == d
        with pytest.raises(AssertionError):  # different parameters or overwrite: rebuild
            make_tiny_model(tmp_path / "m", "mistral", seed=1)
        with pytest.raises(AssertionError):
            make_tiny_model(tmp_path / "m", "mistral", overwrite=True)
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    make_tiny_model(tmp_path / "m", "mistral", seed=1)  # a stale build is replaced
    assert json.loads((d / tm.MANIFEST).read_text())["params"]["seed"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


def test_publish_keeps_race_winner(tmp_path: Path) -> None:
    final = make_tiny_model(tmp_path / "m", "llama")
    manifest = json.loads((final / tm.MANIFEST).read_text())
    loser = tmp_path / "loser"
    loser.mkdir()
    tm._publish(loser, final, manifest, overwrite=False)
    assert loser.exists() and (final / "model.safetensors").is_file()


def test_demo_model(cache: Path) -> None:
    d = default_demo_model_path()
    assert d.parent == cache / "models"
    config = AutoConfig.from_pretrained(d)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (256, 4, 688)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert default_demo_model_path() == d


def test_tokenizer_round_trip() -> None:
    tok = AutoTokenizer.from_pretrained(get_tokenizer_dir())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (tk.BOS_TOKEN, tk.EOS_TOKEN,
                                                             tk.PAD_TOKEN)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id  # Llama-3 style: bos is prepended
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids([tk.IM_START, tk.IM_END]) == [3, 4]


def test_tokenizer_cache_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    first = get_tokenizer_dir()
    monkeypatch.setattr(tk, "train_tokenizer", lambda *a: pytest.fail("retrained a cached one"))
    assert get_tokenizer_dir() == first


def test_tokenizer_training_is_deterministic_across_processes(tmp_path: Path) -> None:
    # A fresh interpreter with an empty cache must produce byte-identical files. tokenizer.py is
    # loaded by path so the child does not import the whole engine.
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('tok', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(mod.get_tokenizer_dir())\n"
    )
    env = {**os.environ, "MRV2_CACHE_DIR": str(tmp_path)}
    env.pop("TOKENIZERS_PARALLELISM", None)
    out = subprocess.run([sys.executable, "-c", script, tk.__file__], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    theirs, ours = Path(out), get_tokenizer_dir()
    assert theirs.name == ours.name and theirs.parent.parent == tmp_path
    for name in tk.TOKENIZER_FILES:
        assert hashlib.sha256((theirs / name).read_bytes()).digest() == \
            hashlib.sha256((ours / name).read_bytes()).digest(), name
