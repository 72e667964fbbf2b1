"""LLM end to end with a model's generation config: every EOS id (config.json's list and
generation_config.json's) ends a request, min_tokens masks them all, ignore_eos ignores them
all; `generate` / `chat` without sampling params use generation_config.json's defaults.

The EOS ids are tokens the model really produces: a greedy run with ignore_eos gives the
sequence, and its k-th token is then declared an EOS id of a copy of the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [17, 291, 30, 1002, 45, 7]}
MAX_TOKENS = 12
ARGS = {"max_model_len": 128, "max_num_seqs": 4}


def model_copy(src: Path, dst: Path, config_eos=None, generation_eos=None,
               **generation) -> Path:
    """`src` copied to `dst`, with config.json's / generation_config.json's eos_token_id
    replaced when given, and `generation` set in generation_config.json."""
    shutil.copytree(src, dst)
    for name, eos, extra in (("config.json", config_eos, {}),
                             ("generation_config.json", generation_eos, generation)):
        path = dst / name
        config = json.loads(path.read_text())
        if eos is not None:
            config["eos_token_id"] = eos
        config.update(extra)
        path.write_text(json.dumps(config))
    return dst


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kwargs)


@pytest.fixture(scope="module")
def base(tiny_llama):
    """The model's own EOS (1) and the greedy sequence of PROMPT, run past any EOS."""
    llm = LLM(str(tiny_llama), **ARGS)
    try:
        seq = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
        eos = llm.get_tokenizer().eos_token_id
    finally:
        llm.shutdown()
    return eos, list(seq.token_ids)


@pytest.fixture(scope="module")
def picks(base):
    """Two steps k1 < k2 whose tokens first appear there and are not the model's EOS: each
    ends the request exactly there once it is an EOS id."""
    eos, seq = base
    steps = [k for k in range(1, MAX_TOKENS - 2) if seq[k] not in seq[:k] and seq[k] != eos]
    assert eos not in seq[:steps[1] + 1], "the model's own EOS would stop the request first"
    assert len(steps) >= 2, seq
    return steps[0], steps[1]


@pytest.fixture(scope="module", params=["async", "sync", "multiprocess"])
def engine_kwargs(request):
    return {"async": {}, "sync": {"async_scheduling": False},
            "multiprocess": {"multiprocess_core": True}}[request.param]


@pytest.fixture(scope="module")
def eos_llm(tiny_llama, tmp_path_factory, base, picks, engine_kwargs):
    """A copy whose config.json says eos_token_id [1, seq[k2]] and whose
    generation_config.json adds seq[k1]."""
    eos, seq = base
    k1, k2 = picks
    model = model_copy(tiny_llama, tmp_path_factory.mktemp("eos") / "model",
                       config_eos=[eos, seq[k2]], generation_eos=[eos, seq[k1]])
    llm = LLM(str(model), **ARGS, **engine_kwargs)
    yield llm
    llm.shutdown()


def test_every_eos_id_stops_greedy_generation(eos_llm, base, picks, tiny_llama):
    eos, seq = base
    k1, k2 = picks
    out = eos_llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0]
    # generation_config.json's EOS id seq[k1] ends it, as vLLM reports: finish_reason "stop"
    # and the id as stop_reason (vLLM adds the model's extra EOS ids to stop_token_ids).
    assert out.token_ids == seq[:k1 + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", seq[k1])
    # The config's second EOS id ends a request that starts right after seq[k1].
    prompt = {"prompt_token_ids": PROMPT["prompt_token_ids"] + seq[:k1 + 1]}
    out2 = eos_llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    assert out2.token_ids == seq[k1 + 1:k2 + 1]
    assert (out2.finish_reason, out2.stop_reason) == ("stop", seq[k2])
    # Text and ids as for the same id given as a user stop token id on the original model.
    ref = LLM(str(tiny_llama), **ARGS)
    try:
        want = ref.generate(PROMPT, greedy(stop_token_ids=[seq[k1]]), use_tqdm=False)[0]
    finally:
        ref.shutdown()
    assert (out.text, out.token_ids) == (want.outputs[0].text, want.outputs[0].token_ids)


def test_ignore_eos_ignores_every_eos_id(eos_llm, base):
    out = eos_llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[1] and out.finish_reason == "length"


def test_min_tokens_masks_every_eos_id(eos_llm, base, picks):
    """Before min_tokens no EOS id is sampled: at k1 greedy takes the next best token; once
    min_tokens is reached an EOS id may end the request again."""
    eos, seq = base
    k1, k2 = picks
    out = eos_llm.generate(PROMPT, greedy(min_tokens=k1 + 2), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:k1] == seq[:k1] and out.token_ids[k1] != seq[k1]
    assert not {eos, seq[k1], seq[k2]} & set(out.token_ids[:k1 + 2])
    # The config's id, first hit at k2 - k1 - 1 when the prompt ends right after seq[k1].
    prompt = {"prompt_token_ids": PROMPT["prompt_token_ids"] + seq[:k1 + 1]}
    n = k2 - k1
    out = eos_llm.generate(prompt, greedy(min_tokens=n + 1), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:n - 1] == seq[k1 + 1:k2] and out.token_ids[n - 1] != seq[k2]
    assert not {eos, seq[k1], seq[k2]} & set(out.token_ids[:n + 1])


def test_generate_without_params_uses_generation_config_defaults(tiny_llama, tmp_path, base):
    eos, seq = base
    assert eos not in seq[:5]
    model = model_copy(tiny_llama, tmp_path / "model", temperature=0.0, max_new_tokens=5,
                       top_k=7, repetition_penalty=1.0)
    llm = LLM(str(model), **ARGS)
    try:
        defaults = llm.get_default_sampling_params()
        assert defaults == SamplingParams(temperature=0.0, max_tokens=5, top_k=7,
                                          repetition_penalty=1.0)
        assert llm.get_default_sampling_params() is not defaults  # a fresh object per call
        # temperature 0 (greedy) and max_new_tokens=5 from generation_config.json.
        out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == seq[:5] and out.finish_reason == "length"
        out = llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) <= 5
        assert llm.chat([{"role": "user", "content": "hello"}], use_tqdm=False)[0].outputs[0] \
            .token_ids == out.token_ids  # greedy: the same reply again
        # Explicit params are used as given.
        out = llm.generate(PROMPT, greedy(ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == seq
    finally:
        llm.shutdown()


def test_generation_config_modes(tiny_llama, tmp_path):
    model = model_copy(tiny_llama, tmp_path / "model", temperature=0.3, top_p=0.8)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"min_p": 0.2,
                                                              "max_new_tokens": 9}))
    for mode, want in (("vllm", SamplingParams()),
                       (str(other), SamplingParams(min_p=0.2, max_tokens=9))):
        llm = LLM(str(model), generation_config=mode, **ARGS)
        try:
            assert llm.get_default_sampling_params() == want
        finally:
            llm.shutdown()
    with pytest.raises(ValueError, match="generation-config"):
        LLM(str(model), generation_config=str(tmp_path / "nowhere"), **ARGS)
    # The server reads the same defaults (one implementation).
    from mrv2.entrypoints.openai.generation_config import default_sampling_params

    assert default_sampling_params(str(model)) == {"temperature": 0.3, "top_p": 0.8}
