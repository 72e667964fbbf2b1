"""End to end: LLM.generate against transformers' greedy generate, and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import ConfigError
from mrv2.engine.input_processor import PromptError

PROMPT_LENS = [1, 2, 3, 5, 8, 15, 16, 17, 31, 64, 100, 127, 128, 129, 200, 300]
MAX_TOKENS = 64


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # ignore_eos: generation must not stop at EOS, and EOS must stay sampleable.
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def greedy_case(tiny_llama):
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, hf_greedy(tiny_llama, prompts, MAX_TOKENS)


def _generate(model_dir, prompts, **llm_kwargs):
    llm = LLM(str(model_dir), max_model_len=512, block_size=16, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outputs


def test_greedy_matches_transformers_with_chunked_prefill(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, output, want in zip(prompts, outputs, expected):
        completion = output.outputs[0]
        assert output.finished and completion.finish_reason == "length"
        assert completion.token_ids == want, f"prompt of {len(prompt)} tokens diverged"


def test_greedy_matches_transformers_under_preemption(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    # 60 blocks of 16 tokens cannot hold all 16 requests (they need ~200): the scheduler must
    # preempt and resume requests, and the outputs must not change.
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128,
                             kv_cache_memory_gb=60 * block_bytes / (1 << 30))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_max_num_seqs_limits_the_batch(tiny_llama, greedy_case):
    prompts, expected = greedy_case
    _, outputs = _generate(tiny_llama, prompts[:6], max_num_seqs=2, max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:6]


def test_text_prompts_stop_at_eos_and_stop_token_ids(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    base = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    assert base.prompt == "hello world"
    assert base.prompt_token_ids == tokenizer("hello world").input_ids
    assert base.outputs[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    # Stopping at the 5th generated token's id, unless it already appeared earlier.
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                     stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens suppresses the stop until enough tokens were generated.
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20,
                                                     min_tokens=first + 2,
                                                     stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1


def test_seeded_sampling_is_reproducible_and_batch_invariant(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("a seeded prompt", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16) for _ in range(5)]
    batch = llm.generate(["x y z", "other", "a seeded prompt", "more text", "zz", "q"],
                         others[:2] + [params] + others[2:], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a, b = llm.generate(["same", "same"], unseeded, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_seeded_request_alone_among_16_others_and_at_another_position(tiny_llama):
    """Issue 4: a seeded request (temperature 0.8, seed 1234) draws the same tokens, with the
    same logprobs, alone, first in a batch of 16 others and last in it."""
    llm = LLM(str(tiny_llama), max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True,
                            logprobs=2)
    prompt = "the seeded request's prompt"
    rng = random.Random(0)
    others = [{"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 90))]}
              for _ in range(16)]
    other_params = [SamplingParams(temperature=t, max_tokens=rng.randrange(4, 30),
                                   top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, i]))
                    for i, t in enumerate([0.0, 0.8, 1.0, 1.3] * 4)]
    [alone] = llm.generate(prompt, params, use_tqdm=False)
    first = llm.generate([prompt, *others], [params, *other_params], use_tqdm=False)[0]
    last = llm.generate([*others, prompt], [*other_params, params], use_tqdm=False)[-1]
    want = alone.outputs[0]
    assert len(set(want.token_ids)) > 4  # really sampled
    for got in (first.outputs[0], last.outputs[0]):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert list(a) == list(b)
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    llm.shutdown()


@pytest.mark.parametrize("kwargs, error, words", [
    ({"block_size": 12}, ConfigError, ["block_size=12", "power of two"]),
    ({"max_model_len": 10**6}, ConfigError, ["max_model_len=1000000"]),
    ({"dtype": "int7"}, ValueError, ["int7"]),
])
def test_bad_engine_args(tiny_llama, kwargs, error, words):
    with pytest.raises(error) as info:
        LLM(str(tiny_llama), **kwargs)
    assert all(w in str(info.value) for w in words)


def test_missing_model_and_dir_without_config(tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found|No such"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tiny_model_factory, tmp_path):
    import json
    import shutil

    src = tiny_model_factory("llama")
    dst = tmp_path / "gpt2ish"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:
        LLM(str(dst))
    assert "GPT2LMHeadModel" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def _set_after_construction(**fields) -> SamplingParams:
    """Params whose fields were changed after SamplingParams validated them."""
    params = SamplingParams(max_tokens=4)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.fixture(scope="module")
def small_llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=64)


@pytest.mark.parametrize("prompt, params, error, words", [
    ("", None, PromptError, ["empty"]),
    ({"prompt_token_ids": []}, None, PromptError, ["empty"]),
    ({"prompt_token_ids": list(range(3, 67))}, None, PromptError, ["64", "max_model_len"]),
    ({"prompt_token_ids": list(range(3, 103))}, None, PromptError, ["100", "64"]),
    ({"prompt_token_ids": [1, 10**7]}, None, PromptError, ["10000000", "vocabulary"]),
    (123, None, PromptError, ["int"]),
    ("hi", _set_after_construction(logprobs=21), ValueError, ["logprobs=21", "[0, 20]"]),
    ("hi", SamplingParams(logit_bias={10**7: 1.0}), ValueError, ["logit_bias", "vocabulary"]),
])
def test_bad_prompts_are_rejected_before_any_work(small_llm, prompt, params, error, words):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(error) as info:
        small_llm.generate([good, prompt], params or SamplingParams(max_tokens=4),
                           use_tqdm=False)
    assert all(w in str(info.value) for w in words), str(info.value)
    # Nothing was added, and the engine still serves.
    assert not small_llm.llm_engine.has_unfinished_requests()
    out = small_llm.generate(good, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_list_must_match_prompts(small_llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        small_llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_identical_with_async_scheduling_on_and_off(tiny_llama, greedy_case,
                                                          async_scheduling):
    prompts, expected = greedy_case
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4
    llm, outputs = _generate(tiny_llama, prompts, max_num_batched_tokens=128,
                             kv_cache_memory_gb=60 * block_bytes / (1 << 30),
                             async_scheduling=async_scheduling)
    assert llm.llm_engine.config.scheduler_config.async_scheduling is async_scheduling
    assert [o.outputs[0].token_ids for o in outputs] == expected
    core = llm.llm_engine.engine_core
    assert core.executor.worker.runner.requests.num_active == 0
    assert core.scheduler.kv_cache_usage == 0


# -- vLLM's engine keyword arguments: every engine flag of `mrv2 serve` is one of LLM's ---------

# `mrv2 serve`'s own flags, by dest: HTTP, TLS, CORS, request logging, the chat template, tool
# calling. Every other flag is an engine setting, so an LLM keyword argument of its dest's name.
SERVER_ONLY_DESTS = {
    "help", "model_tag", "host", "port", "api_key", "served_model_name", "chat_template",
    "enable_auto_tool_choice", "tool_call_parser", "uvicorn_log_level", "config",
    "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "ssl_keyfile",
    "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path", "enable_log_requests",
    "disable_log_requests", "max_log_len", "enable_server_load_tracking",
    "disable_uvicorn_access_log", "disable_fastapi_docs"}
# Each engine flag with a value it takes (not its default, where it takes another).
ENGINE_FLAGS = {
    "model": ["--model", "/other"], "tokenizer": ["--tokenizer", "org/tok"],
    "hf_config_path": ["--hf-config-path", "cfg"], "revision": ["--revision", "v2"],
    "tokenizer_revision": ["--tokenizer-revision", "v3"],
    "download_dir": ["--download-dir", "/cache"], "dtype": ["--dtype", "float32"],
    "quantization": ["--quantization", "gguf"], "max_model_len": ["--max-model-len", "64"],
    "max_num_seqs": ["--max-num-seqs", "4"],
    "max_num_batched_tokens": ["--max-num-batched-tokens", "128"],
    "block_size": ["--block-size", "32"], "seed": ["--seed", "5"],
    "kv_cache_memory_gb": ["--kv-cache-memory-gb", "0.5"],
    "kv_cache_memory_bytes": ["--kv-cache-memory-bytes", "1000000"],
    "kv_cache_dtype": ["--kv-cache-dtype", "bfloat16"],
    "gpu_memory_utilization": ["--gpu-memory-utilization", "0.5"],
    "tensor_parallel_size": ["-tp", "2"], "enable_prefix_caching": ["--no-enable-prefix-caching"],
    "enforce_eager": ["--enforce-eager"], "async_scheduling": ["--no-async-scheduling"],
    "generation_config": ["--generation-config", "vllm"],
    "reasoning_parser": ["--reasoning-parser", "qwen3"],
    "structured_outputs_config": ["--structured-outputs-config", '{"backend": "xgrammar"}'],
    "optimization_level": ["-O0"], "compilation_config": ["-cc", '{"cudagraph_mode": "FULL"}'],
    "max_logprobs": ["--max-logprobs", "5"], "trust_remote_code": ["--trust-remote-code"],
    "tokenizer_mode": ["--tokenizer-mode", "hf"],
    "load_format": ["--load-format", "safetensors"], "swap_space": ["--swap-space", "4"],
    "hf_overrides": ["--hf-overrides", "{}"],
    "enable_chunked_prefill": ["--no-enable-chunked-prefill"],
    "distributed_executor_backend": ["--distributed-executor-backend", "mp"],
    "logprobs_mode": ["--logprobs-mode", "processed_logits"],
    "batch_invariant": ["--batch-invariant"],
    "pipeline_parallel_size": ["-pp", "1"], "data_parallel_size": ["-dp", "1"],
    "data_parallel_backend": ["-dpb", "mp"],
    "scheduling_policy": ["--scheduling-policy", "fcfs"], "runner": ["--runner", "pooling"],
    "convert": ["--convert", "embed"], "pooler_config": ["--pooler-config", '{"normalize": false}'],
    "speculative_config": ["--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 2}'],
    "disable_log_stats": ["--disable-log-stats"],
    "override_generation_config": ["--override-generation-config", '{"temperature": 0.5}'],
    "num_scheduler_steps": ["--num-scheduler-steps", "4"],
    "enable_expert_parallel": ["--enable-expert-parallel"],
}


class _EngineArgsSeen(Exception):
    """What a stand-in LLMEngine raises: the EngineArgs that LLM built, and no engine."""


def llm_engine_args(monkeypatch, **kwargs):
    """The EngineArgs `LLM(**kwargs)` builds (its engine is never started)."""
    import mrv2.entrypoints.llm as llm_module

    def stand_in(engine_args, multiprocess_core=False):
        raise _EngineArgsSeen(engine_args)

    monkeypatch.setattr(llm_module, "LLMEngine", stand_in)
    with pytest.raises(_EngineArgsSeen) as seen:
        LLM(**kwargs)
    return seen.value.args[0]


def serve_args(*argv: str):
    from mrv2.entrypoints.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_every_serve_flag_is_an_llm_keyword_or_the_servers_own():
    import dataclasses

    from mrv2.engine.arg_utils import EngineArgs
    from mrv2.entrypoints.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    engine_dests = {action.dest for action in serve._actions} - SERVER_ONLY_DESTS
    # A new engine flag needs its LLM keyword (an EngineArgs field of its dest's name) and a
    # case in ENGINE_FLAGS; a new server flag goes to SERVER_ONLY_DESTS.
    assert engine_dests == set(ENGINE_FLAGS)
    assert engine_dests <= {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize("dest", sorted(ENGINE_FLAGS))
def test_a_serve_flag_and_the_llm_keyword_of_its_name_agree(dest, monkeypatch):
    from mrv2.entrypoints.openai.cli_args import engine_args_from, resolve_model

    args = serve_args(*([] if dest == "model" else ["/m"]), *ENGINE_FLAGS[dest])
    model = resolve_model(args)
    served = engine_args_from(args, model)
    assert getattr(served, dest) == getattr(args, dest)  # the flag's value, as it is
    # LLM's default of disable_log_stats is True (vLLM's LLM), the server's False.
    kwargs = {"model": model, "disable_log_stats": served.disable_log_stats,
              dest: getattr(args, dest)}
    assert llm_engine_args(monkeypatch, **kwargs) == served


def test_llm_defaults_are_the_servers_but_for_the_stats_log(monkeypatch):
    import dataclasses

    from mrv2.entrypoints.openai.cli_args import engine_args_from

    got = llm_engine_args(monkeypatch, model="/m")
    assert got.disable_log_stats
    assert dataclasses.replace(got, disable_log_stats=False) == \
        engine_args_from(serve_args("/m"), "/m")


@pytest.mark.parametrize("dest, argv", [
    ("tokenizer_mode", ["--tokenizer-mode", "mistral"]),
    ("load_format", ["--load-format", "pt"]),
    ("load_format", ["--load-format", "gguf"]),  # /m is no GGUF file
    ("swap_space", ["--swap-space", "8"]),
    ("hf_overrides", ["--hf-overrides", '{"rope_theta": 1}']),
    ("optimization_level", ["-O", "7"]),
    ("compilation_config", ["-cc", "9"]),
    ("scheduling_policy", ["--scheduling-policy", "priority"]),
    ("distributed_executor_backend", ["--distributed-executor-backend", "external_launcher"]),
    ("generation_config", ["--generation-config", "bogus"]),
    ("override_generation_config", ["--override-generation-config", '{"do_sample": true}']),
])
def test_a_refused_value_is_refused_the_same_way_by_llm_and_serve(dest, argv, monkeypatch,
                                                                  capsys):
    from mrv2.entrypoints.cli import main
    from mrv2.entrypoints.openai.cli_args import server_config_from

    args = serve_args("/m", *argv)
    with pytest.raises(ValueError) as served:
        server_config_from(args, "/m")
    with pytest.raises(ValueError) as offline:
        llm_engine_args(monkeypatch, model="/m", **{dest: getattr(args, dest)})
    assert (offline.type, str(offline.value)) == (served.type, str(served.value))
    assert dest in str(served.value) or dest.replace("_", "-") in str(served.value)
    assert main(["serve", "/m", *argv]) == 2
    assert f"mrv2: error: {served.value}" in capsys.readouterr().err


@pytest.mark.parametrize("name, value", [("cpu_offload_gb", 4), ("max_seq_len_to_capture", 8192),
                                         ("disable_custom_all_reduce", True)])
def test_a_vllm_keyword_mrv2_does_not_implement_is_refused_by_name(name, value, monkeypatch):
    from mrv2.engine.engine_args_checks import UnimplementedOptionError

    with pytest.raises(UnimplementedOptionError, match=f"mrv2 does not implement vLLM's {name}"):
        llm_engine_args(monkeypatch, model="/m", **{name: value})
    with pytest.raises(TypeError, match="no_such_keyword"):  # not a vLLM option: Python's error
        llm_engine_args(monkeypatch, model="/m", no_such_keyword=1)


def test_vllm_example_keywords_generate_as_without_them(tiny_llama, small_llm):
    """`LLM(model, trust_remote_code=True, ...)`, as vLLM's examples write it: permissions and
    no-ops that change nothing (override_generation_config sets the default max_tokens)."""
    llm = LLM(str(tiny_llama), max_model_len=64, trust_remote_code=True, tokenizer_mode="hf",
              load_format="safetensors", swap_space=4, hf_overrides={}, optimization_level=3,
              pipeline_parallel_size=1, data_parallel_size=1, scheduling_policy="fcfs",
              override_generation_config={"max_new_tokens": 5})
    try:
        assert llm.get_default_sampling_params().max_tokens == 5
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompt = {"prompt_token_ids": [11, 12, 13, 14]}
        [got] = llm.generate(prompt, params, use_tqdm=False)
        [want] = small_llm.generate(prompt, params, use_tqdm=False)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
