"""mrv2.testing.gguf_writer: the GGUF files read back as the model they came from.

transformers' own GGUF loader (which undoes llama.cpp's q/k permutation and rebuilds the
tokenizer from the metadata) is the independent reference: a file it loads into the same logits
and token ids holds what convert_hf_to_gguf.py would have written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from mrv2.testing import make_tiny_model
from mrv2.testing.gguf_writer import WRITABLE_TYPES, write_gguf

# The archs written here as the tiny factory builds them (Gemma's converters drop lm_head and the
# tokenizer's extra rows: tests/entrypoints/test_llm_gguf.py checks those files on checkpoints
# that follow llama.cpp's Gemma conventions).
ARCHS = ("llama", "mistral", "qwen2", "qwen3")

F32 = gguf.GGMLQuantizationType.F32
F16 = gguf.GGMLQuantizationType.F16
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
TEXTS = ["héllo wörld 你好 🙂", "  two leading spaces\n\ttab  ", "def f(x):\n    return x ** 2",
         "I've 1234567 <|im_start|>user\nhi<|im_end|>", "Ωμέγα — ½ ∑ ∞", ""]
IDS = list(range(0, 2000, 61))  # 33 positions spread over the vocab
# Relative RMS error of dequantize(file tensor) vs the HF tensor, worst tensor of the tiny llama:
# measured 0 / 2.1e-4 / 1.7e-3 / 5.4e-3 / 0.088 / 0.079 / 0.044 / 0.039; bounds ~1.5x that.
MAX_REL_ERR = {"F32": 0.0, "F16": 3.5e-4, "BF16": 2.6e-3, "Q8_0": 8e-3, "Q4_0": 0.13, "Q4_1": 0.12,
               "Q5_0": 0.065, "Q5_1": 0.06}


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private cache dir for this module: the tokenizer is trained once here."""
    root = tmp_path_factory.mktemp("mrv2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MRV2_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Any:
    """build(arch, **kwargs) -> model dir, one build per distinct request."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}

    def _build(arch: str = "llama", **kwargs: Any) -> Path:
        key = f"{arch}-{sorted(kwargs.items())!r}"
        if key not in built:
            built[key] = make_tiny_model(root / f"{arch}-{len(built)}", arch, **kwargs)
        return built[key]
    return _build


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, build: Any) -> Any:
    """gguf_file(arch, tensor_type) -> a single GGUF file, alone in its own dir (so nothing can
    be read from the HF files by mistake)."""
    root = tmp_path_factory.mktemp("gguf")
    written: dict[tuple[str, str], Path] = {}

    def _file(arch: str, tensor_type: str = "F32") -> Path:
        if (arch, tensor_type) not in written:
            out = root / f"{arch}-{tensor_type}" / "model.gguf"
            (path,) = write_gguf(build(arch), out, tensor_type)
            written[(arch, tensor_type)] = path
        return written[(arch, tensor_type)]
    return _file


@pytest.fixture(scope="module")
def reader(gguf_file: Any) -> Any:
    """reader(arch, tensor_type) -> GGUFReader of gguf_file(...), parsed once (~0.4 s each)."""
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def _reader(arch: str, tensor_type: str = "F32") -> gguf.GGUFReader:
        if (arch, tensor_type) not in readers:
            readers[(arch, tensor_type)] = gguf.GGUFReader(gguf_file(arch, tensor_type))
        return readers[(arch, tensor_type)]
    return _reader


@pytest.fixture(scope="module")
def hf_logits(build: Any) -> Any:
    """hf_logits(arch) -> the HF model's logits on IDS, computed once per arch."""
    done: dict[str, torch.Tensor] = {}

    def _logits_of(arch: str) -> torch.Tensor:
        if arch not in done:
            done[arch] = _logits(AutoModelForCausalLM.from_pretrained(
                build(arch), dtype=torch.float32).eval())
        return done[arch]
    return _logits_of


def _hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def _tensor(t: Any) -> np.ndarray:
    """A file tensor dequantized to float32, in numpy (row-major, HF) shape."""
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def _gguf_model(path: Path, model_dir: Path, arch: str) -> Any:
    # transformers maps no head_dim for qwen3 GGUFs (Qwen3Config would default it to 128), so that
    # arch gets its config from the HF dir; the weights still come from the file alone.
    kwargs = {"config": AutoConfig.from_pretrained(model_dir)} if arch == "qwen3" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_gives_the_hf_logits(build: Any, gguf_file: Any, hf_logits: Any,
                                      arch: str) -> None:
    got = _gguf_model(gguf_file(arch), build(arch), arch)
    torch.testing.assert_close(_logits(got), hf_logits(arch), atol=1e-5, rtol=0)


# (qwen2 Q8_0 through transformers: test_tied_sharded_odd_width_model.)
@pytest.mark.parametrize("arch,tensor_type,max_rel,min_agree", [
    ("llama", "F16", 3e-3, 0.9), ("llama", "Q8_0", 0.05, 0.8)])
def test_quantized_file_gives_close_logits(build: Any, gguf_file: Any, hf_logits: Any, arch: str,
                                           tensor_type: str, max_rel: float,
                                           min_agree: float) -> None:
    ref = hf_logits(arch)
    got = _logits(_gguf_model(gguf_file(arch, tensor_type), build(arch), arch))
    assert 0 < ((got - ref).norm() / ref.norm()).item() < max_rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= min_agree


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_tokenizer_encodes_like_the_hf_one(build: Any, gguf_file: Any, arch: str) -> None:
    path = gguf_file(arch)
    hf = AutoTokenizer.from_pretrained(build(arch))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:  # all NFC: the qwen2 HF pipeline NFC-normalises, a GGUF vocab cannot
        assert tok(text).input_ids == hf(text).input_ids, text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (hf.bos_token, hf.eos_token,
                                                             hf.pad_token)


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_is_the_converters(build: Any, reader: Any, arch: str) -> None:
    model_dir = build(arch)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    r = reader(arch)
    g = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    assert _field(r, "general.architecture") == g
    assert _field(r, "general.type") == "model"
    assert _field(r, "general.name") == gguf.Metadata.load(None, model_dir).name  # dir-name based
    assert _field(r, "general.file_type") == gguf.LlamaFileType.ALL_F32
    assert _field(r, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    expected = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
        "rope.freq_base": cfg["rope_parameters"]["rope_theta"],
    }
    if g == "llama":  # LlamaModel.set_gguf_parameters only
        expected.update({"vocab_size": cfg["vocab_size"], "rope.dimension_count": cfg["head_dim"]})
    for key, value in expected.items():
        assert _field(r, f"{g}.{key}") == value, key
    assert _field(r, f"{g}.attention.layer_norm_rms_epsilon") == pytest.approx(cfg["rms_norm_eps"])
    assert not any(k.startswith(f"{g}.rope.scaling") for k in r.fields)  # rope_type "default"
    if g != "llama":
        assert f"{g}.vocab_size" not in r.fields and f"{g}.rope.dimension_count" not in r.fields
    # Tokenizer: _set_vocab_gpt2.
    assert _field(r, "tokenizer.ggml.model") == "gpt2"
    assert _field(r, "tokenizer.ggml.pre") == ("qwen2" if arch == "qwen2" else "gpt-2")
    tokens = _field(r, "tokenizer.ggml.tokens")
    types = _field(r, "tokenizer.ggml.token_type")
    vocab = tok_json["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tok_json["added_tokens"]}
    assert len(tokens) == len(types) == cfg["vocab_size"]
    for i, (token, token_type) in enumerate(zip(tokens, types)):
        if i in added:
            assert (token, token_type) == (added[i], gguf.TokenType.CONTROL)
        elif i < len(vocab):
            assert token_type == gguf.TokenType.NORMAL and vocab[token] == i
        else:
            assert (token, token_type) == (f"[PAD{i}]", gguf.TokenType.UNUSED)
    assert _field(r, "tokenizer.ggml.merges") == [" ".join(m) for m in tok_json["model"]["merges"]]
    assert _field(r, "tokenizer.ggml.bos_token_id") == cfg["bos_token_id"]
    assert _field(r, "tokenizer.ggml.eos_token_id") == cfg["eos_token_id"]
    assert _field(r, "tokenizer.ggml.padding_token_id") == cfg["pad_token_id"]
    assert "tokenizer.ggml.unknown_token_id" not in r.fields  # the tokenizer has none
    assert _field(r, "tokenizer.ggml.add_bos_token") is True  # from the TemplateProcessing
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert _field(r, "tokenizer.chat_template") == tok_config["chat_template"]


@pytest.mark.parametrize("arch", ARCHS)
def test_q_and_k_are_permuted_for_llama_only(build: Any, reader: Any, arch: str) -> None:
    hf = _hf_tensors(build(arch))
    cfg = json.loads((build(arch) / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    file = {t.name: _tensor(t) for t in reader(arch).tensors}
    undo = LlamaTensorProcessor()._reverse_permute_weights  # transformers' inverse, not ours
    for layer in range(cfg["num_hidden_layers"]):
        for proj, heads in (("q", n_head), ("k", n_kv)):
            want = hf[f"model.layers.{layer}.self_attn.{proj}_proj.weight"].numpy()
            got = file[f"blk.{layer}.attn_{proj}.weight"]
            if arch in ("llama", "mistral"):
                assert not np.array_equal(got, want)  # the layout really changed
                np.testing.assert_array_equal(undo(got, n_head, heads), want)
            else:
                np.testing.assert_array_equal(got, want)
        if arch == "qwen2":
            np.testing.assert_array_equal(file[f"blk.{layer}.attn_q.bias"],
                                          hf[f"model.layers.{layer}.self_attn.q_proj.bias"].numpy())


@pytest.mark.parametrize("tensor_type", WRITABLE_TYPES)
def test_every_writable_type_round_trips(build: Any, reader: Any, tensor_type: str) -> None:
    want_type = gguf.GGMLQuantizationType[tensor_type]
    r = reader("llama", tensor_type)
    assert _field(r, "general.file_type") == getattr(
        gguf.LlamaFileType, "ALL_F32" if tensor_type == "F32" else f"MOSTLY_{tensor_type}")
    hf = _hf_tensors(build("llama"))
    cfg = json.loads((build("llama") / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    file = {t.name: t for t in r.tensors}
    assert len(file) == len(hf)
    # Only the 2-D weights are quantized; norms stay F32 (llama.cpp's rule).
    for t in r.tensors:
        assert t.tensor_type == (want_type if len(t.shape) == 2 else F32), t.name
    undo = LlamaTensorProcessor()._reverse_permute_weights
    for name, want_t in hf.items():
        want = want_t.numpy()
        got = _tensor(file[names.get_name(name, try_suffixes=(".weight", ".bias"))])
        if name.endswith("q_proj.weight"):
            got = undo(got, n_head, n_head)
        elif name.endswith("k_proj.weight"):
            got = undo(got, n_head, n_kv)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert rel <= MAX_REL_ERR[tensor_type], (name, rel)
        if tensor_type != "F32" and want.ndim == 2:
            assert rel > 0, name  # really quantized


def test_tied_sharded_odd_width_model(build: Any, tmp_path: Path) -> None:
    # hidden 48: rows of 48 cannot be Q8_0 blocks (32) -> the converter's F16 fallback;
    # ffn_down rows are 96 wide -> Q8_0. Tied -> no output.weight. 3 safetensors shards.
    model_dir = build("qwen2", tie_word_embeddings=True, hidden_size=48, num_heads=4,
                      num_kv_heads=2, intermediate_size=96, num_shards=3)
    (path,) = write_gguf(model_dir, tmp_path / "m.gguf", "Q8_0")
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert "output.weight" not in types
    assert len(types) == len(_hf_tensors(model_dir))
    assert types["token_embd.weight"] == F16 and types["blk.0.attn_q.weight"] == F16
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.bias"] == F32 and types["output_norm.weight"] == F32
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                               dtype=torch.float32).eval()
    assert got.config.tie_word_embeddings
    ref_logits, got_logits = _logits(ref), _logits(got)
    assert ((got_logits - ref_logits).norm() / ref_logits.norm()).item() < 0.05


def test_llama3_rope_freqs_tensor(build: Any, tmp_path: Path) -> None:
    model_dir = build("llama", rope_scaling=LLAMA3_ROPE)
    (path,) = write_gguf(model_dir, tmp_path / "m.gguf", "Q8_0")
    r = gguf.GGUFReader(path)
    first = r.tensors[0]  # generate_extra_tensors come before the checkpoint's tensors
    assert first.name == "rope_freqs.weight" and first.tensor_type == F32
    # The divisors of the default inverse frequencies that give transformers' llama3 ones.
    cfg = AutoConfig.from_pretrained(model_dir)
    inv_llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    dim = cfg.head_dim
    inv_default = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = torch.from_numpy(_tensor(first).copy())
    torch.testing.assert_close(factors, inv_default / inv_llama3, rtol=1e-5, atol=0)
    assert factors.min() == 1.0 and factors.max() == LLAMA3_ROPE["factor"]  # both regimes hit
    assert not any(".rope.scaling" in k for k in r.fields)


@pytest.mark.parametrize("rope,keys", [
    ({"rope_type": "linear", "factor": 2.0},
     {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
      "beta_fast": 32.0, "beta_slow": 1.0},
     {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
      "rope.scaling.original_context_length": 512, "rope.scaling.yarn_beta_fast": 32.0,
      "rope.scaling.yarn_beta_slow": 1.0}),
])
def test_rope_scaling_keys(build: Any, tmp_path: Path, rope: dict[str, Any],
                           keys: dict[str, Any]) -> None:
    (path,) = write_gguf(build("llama", rope_scaling=rope), tmp_path / "m.gguf", "F16")
    r = gguf.GGUFReader(path)
    got = {k.removeprefix("llama."): _field(r, k) for k in r.fields if ".rope.scaling" in k}
    assert got == keys
    assert all(t.name != "rope_freqs.weight" for t in r.tensors)


def test_split_files(build: Any, reader: Any, tmp_path: Path) -> None:
    files = write_gguf(build("llama"), tmp_path / "m.gguf", "F16", num_splits=3)
    assert [f.name for f in files] == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    whole = reader("llama", "F16")
    readers = [gguf.GGUFReader(f) for f in files]
    split_keys = {"split.no", "split.count", "split.tensors.count"}
    for i, r in enumerate(readers):
        assert (_field(r, "split.no"), _field(r, "split.count")) == (i, 3)
        assert _field(r, "split.tensors.count") == len(whole.tensors)
        assert r.tensors, "every file holds tensors"
        own = {k for k in r.fields if not k.startswith("GGUF.")}
        if i == 0:  # all the metadata, plus the split keys
            meta = {k for k in whole.fields if not k.startswith("GGUF.")}
            assert own == split_keys | meta
            assert all(_field(r, k) == _field(whole, k) for k in meta)
        else:
            assert own == split_keys
    parts = [t for r in readers for t in r.tensors]
    assert [t.name for t in parts] == [t.name for t in whole.tensors]
    for got, want in zip(parts, whole.tensors):
        assert got.tensor_type == want.tensor_type
        np.testing.assert_array_equal(got.data, want.data)


def test_bad_arguments(build: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensor_type"):
        write_gguf(build("llama"), tmp_path / "m.gguf", "Q4_K")
    with pytest.raises(ValueError, match="num_splits"):
        write_gguf(build("llama"), tmp_path / "m.gguf", "F16", num_splits=1000)
    with pytest.raises(ValueError, match="num_splits"):
        write_gguf(build("llama"), tmp_path / "m.gguf", "F16", num_splits=0)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_tensor_types_give_some_tensors_another_type(build: Any, tmp_path: Path) -> None:
    # A mixed file as llama.cpp's Q4_K_M is: most weights of one type, attn_v and the output of
    # another; norms stay F32 whatever is asked.
    (path,) = write_gguf(build("llama"), tmp_path / "mixed.gguf", "Q4_0",
                         tensor_types={"attn_v.weight": "Q8_0", "output.weight": "F16"})
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["output.weight"] == "F16"
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.ffn_down.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32"
    with pytest.raises(ValueError, match="not writable"):
        write_gguf(build("llama"), tmp_path / "bad.gguf", "Q4_0",
                   tensor_types={"attn_v.weight": "Q6_K"})
