"""Every `vllm serve` flag mrv2 knows is parsed, and either honoured (its value reaches
EngineArgs or ServerConfig) or refused with a message naming it: none is accepted and ignored.
Parser-level only (no server, no model)."""

from __future__ import annotations

import pytest

from mrv2.entrypoints.cli import build_parser
from mrv2.entrypoints.openai.cli_args import engine_args_from, resolve_model, server_config_from
from mrv2.entrypoints.openai.config_file import expand_config_file
from mrv2.entrypoints.openai.vllm_serve_options import VLLM_SERVE_OPTIONS

# (argv after `serve /m`, where the value lands: "engine" | "server", the field, its value).
# The names are vLLM's (docs.vllm.ai, `vllm serve` arguments).
HONOURED = [
    (["--host", "0.0.0.0"], "server", "host", "0.0.0.0"),
    (["--port", "9001"], "server", "port", 9001),
    (["--api-key", "k"], "server", "api_key", "k"),
    (["--served-model-name", "a", "b"], "server", "served_model_names", ["a", "b"]),
    (["--chat-template", "{{ x }}"], "server", "chat_template", "{{ x }}"),
    (["--generation-config", "vllm"], "server", "generation_config", "vllm"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "server",
     "tool_call_parser", "hermes"),
    (["--reasoning-parser", "qwen3"], "server", "reasoning_parser", "qwen3"),
    (["--uvicorn-log-level", "debug"], "server", "uvicorn_log_level", "debug"),
    (["--trust-remote-code"], "engine", "trust_remote_code", True),
    (["--tokenizer-mode", "hf"], "engine", "tokenizer_mode", "hf"),
    (["--load-format", "safetensors"], "engine", "load_format", "safetensors"),
    (["--disable-log-stats"], "server", "disable_log_stats", True),
    (["--enable-log-requests"], "server", "enable_log_requests", True),
    (["--disable-log-requests"], "server", "enable_log_requests", False),
    (["--max-log-len", "50"], "server", "max_log_len", 50),
    (["--allowed-origins", '["http://a"]'], "server", "allowed_origins", ["http://a"]),
    (["--allowed-methods", '["GET"]'], "server", "allowed_methods", ["GET"]),
    (["--allowed-headers", '["X-A"]'], "server", "allowed_headers", ["X-A"]),
    (["--allow-credentials"], "server", "allow_credentials", True),
    (["--ssl-cert-reqs", "2"], "server", "ssl_cert_reqs", 2),
    (["--root-path", "/api"], "server", "root_path", "/api"),
    (["--no-enable-server-load-tracking"], "server", "enable_server_load_tracking", False),
    (["--disable-uvicorn-access-log"], "server", "disable_uvicorn_access_log", True),
    (["--disable-fastapi-docs"], "server", "disable_fastapi_docs", True),
    (["--override-generation-config", '{"temperature": 0.5}'], "server",
     "override_generation_config", {"temperature": 0.5}),
    (["--max-logprobs", "5"], "server", "max_logprobs", 5),
    (["--max-logprobs", "5"], "engine", "max_logprobs", 5),
    (["--tensor-parallel-size", "2"], "engine", "tensor_parallel_size", 2),
    (["-tp", "2"], "engine", "tensor_parallel_size", 2),
    (["--enable-expert-parallel"], "engine", "enable_expert_parallel", True),
    (["-tp", "2", "-ep"], "engine", "enable_expert_parallel", True),
    (["--no-enable-expert-parallel"], "engine", "enable_expert_parallel", False),
    (["--no-enable-prefix-caching"], "engine", "enable_prefix_caching", False),
    (["--enforce-eager"], "engine", "enforce_eager", True),
    (["--no-async-scheduling"], "engine", "async_scheduling", False),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], "engine",
     "structured_outputs_config", {"backend": "xgrammar"}),
    (["--tokenizer", "org/tok"], "engine", "tokenizer", "org/tok"),
    (["--hf-config-path", "cfg"], "engine", "hf_config_path", "cfg"),
    (["--revision", "v2"], "engine", "revision", "v2"),
    (["--tokenizer-revision", "v3"], "engine", "tokenizer_revision", "v3"),
    (["--download-dir", "/cache"], "engine", "download_dir", "/cache"),
    (["--dtype", "float32"], "engine", "dtype", "float32"),
    (["--quantization", "gguf"], "engine", "quantization", "gguf"),
    (["--max-model-len", "64"], "engine", "max_model_len", 64),
    (["--max-num-seqs", "4"], "engine", "max_num_seqs", 4),
    (["--max-num-batched-tokens", "128"], "engine", "max_num_batched_tokens", 128),
    (["--block-size", "32"], "engine", "block_size", 32),
    (["--seed", "5"], "engine", "seed", 5),
    (["--kv-cache-memory-bytes", "1000000"], "engine", "kv_cache_memory_bytes", 1000000),
    (["--gpu-memory-utilization", "0.5"], "engine", "gpu_memory_utilization", 0.5),
    (["--kv-cache-dtype", "bfloat16"], "engine", "kv_cache_dtype", "bfloat16"),
    (["-O0"], "engine", "optimization_level", 0),  # no CUDA graphs (EngineArgs' resolution)
    (["-O", "3"], "engine", "compilation_config", None),  # mrv2's default graphs
    (["--optimization-level", "0"], "engine", "optimization_level", 0),
    (["-O.cudagraph_mode=FULL"], "engine", "compilation_config", {"cudagraph_mode": "FULL"}),
    (["--compilation-config", "0"], "engine", "compilation_config", 0),  # a level, as vLLM's
    (["--compilation-config", '{"cudagraph_mode": "FULL"}'], "engine", "compilation_config",
     {"cudagraph_mode": "FULL"}),
    (["-cc.max_cudagraph_capture_size=64"], "engine", "compilation_config",
     {"max_cudagraph_capture_size": 64}),
    (["-O0", "-cc", '{"cudagraph_mode": "FULL"}'], "engine", "compilation_config",
     {"cudagraph_mode": "FULL"}),  # explicit fields win over the level (EngineArgs merges)
    (["--swap-space", "4"], "engine", "swap_space", 4.0),  # vLLM's default: nothing to do
    (["--swap-space", "0"], "engine", "swap_space", 0.0),
    (["--hf-overrides", "{}"], "engine", "hf_overrides", {}),  # nothing to override
    (["--runner", "pooling"], "engine", "runner", "pooling"),
    (["--no-enable-chunked-prefill"], "engine", "enable_chunked_prefill", False),
    (["--enable-chunked-prefill"], "engine", "enable_chunked_prefill", True),
    (["--distributed-executor-backend", "mp"], "engine", "distributed_executor_backend", "mp"),
    (["--logprobs-mode", "processed_logits"], "engine", "logprobs_mode", "processed_logits"),
    (["-pp", "1", "--data-parallel-size", "1"], "engine", "pipeline_parallel_size", 1),
    (["-dpb", "ray"], "engine", "data_parallel_backend", "ray"),
    (["--scheduling-policy", "fcfs"], "engine", "scheduling_policy", "fcfs"),  # what mrv2 does
    (["--device-memory-utilization", "0.5"], "engine", "gpu_memory_utilization", 0.5),
    (["--no-enforce-eager"], "engine", "enforce_eager", False),
    (["--no-trust-remote-code"], "engine", "trust_remote_code", False),
    (["--generation-config", "vllm"], "engine", "generation_config", "vllm"),
    (["--disable-log-stats"], "engine", "disable_log_stats", True),
    (["--override-generation-config", '{"top_k": 5}'], "engine", "override_generation_config",
     {"top_k": 5}),
    (["--convert", "embed"], "engine", "convert", "embed"),
    (["--pooler-config", '{"pooling_type": "MEAN", "normalize": false}'], "engine",
     "pooler_config", {"pooling_type": "MEAN", "normalize": False}),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 3}'], "engine",
     "speculative_config", {"method": "ngram", "num_speculative_tokens": 3}),
]
# (argv after `serve /m`, the text the error must hold: the flag, and the value where one).
# EngineArgs' refusals name the field, its value and the flag (mrv2/engine/engine_args_checks.py).
REFUSED = [
    (["--hf-overrides", '{"rope_theta": 1}'], "(--hf-overrides)"),
    (["--swap-space", "8"], "swap_space=8.0 (--swap-space)"),
    (["--tokenizer-mode", "mistral"], "tokenizer_mode='mistral' (--tokenizer-mode)"),
    (["--tokenizer-mode", "slow"], "tokenizer_mode='slow' (--tokenizer-mode)"),
    (["--load-format", "pt"], "load_format='pt' (--load-format)"),
    (["--load-format", "gguf"], "load_format='gguf' (--load-format)"),  # /m is not GGUF
    (["--quantization", "awq"], "--quantization"),
    (["-O", "7"], "optimization_level=7 (--optimization-level)"),
    (["--compilation-config", "5"], "compilation_config=5 (--compilation-config)"),
    (["--override-generation-config", '{"do_sample": true}'], "do_sample"),
    (["--override-generation-config", '{"temperature": "hot"}'], "temperature"),
    (["--allowed-origins", '"*"'], "--allowed-origins"),
    (["--ssl-keyfile", "/missing.key", "--ssl-certfile", "/missing.crt"], "--ssl-keyfile"),
    (["--ssl-certfile", "/missing.crt"], "--ssl-keyfile and --ssl-certfile"),
    (["--enable-log-requests", "--disable-log-requests"], "--disable-log-requests"),
    (["--runner", "draft"], "--runner"),
    (["--convert", "classify"], "--convert"),
    (["--pooler-config", "MEAN"], "--pooler-config"),
    (["--scheduling-policy", "priority"], "scheduling_policy='priority' (--scheduling-policy)"),
    (["--distributed-executor-backend", "external_launcher"],
     "distributed_executor_backend='external_launcher'"),
    (["--logprobs-mode", "sampled"], "--logprobs-mode"),
]


def configs(*argv: str):
    parser = build_parser()
    args = parser.parse_args(expand_config_file(parser, ["serve", "/m", *argv]))  # as main()
    model = resolve_model(args)
    return server_config_from(args, model), engine_args_from(args, model)


@pytest.mark.parametrize("argv, where, field, value", HONOURED,
                         ids=[" ".join(case[0]) for case in HONOURED])
def test_honoured_flags_reach_the_config(argv, where, field, value):
    server, engine = configs(*argv)
    assert getattr(server if where == "server" else engine, field) == value


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(case[0]) for case in REFUSED])
def test_refused_flags_name_themselves(argv, message, capsys):
    with pytest.raises((ValueError, SystemExit)) as caught:
        configs(*argv)
    text = str(caught.value) if caught.type is not SystemExit else capsys.readouterr().err
    assert message in text.replace("/-q", "")


def test_tls_files_and_gguf_load_format_are_honoured(tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("key")
    cert.write_text("cert")
    server, _ = configs("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                        "--ssl-ca-certs", str(cert))
    assert (server.ssl_keyfile, server.ssl_certfile, server.ssl_ca_certs) == \
        (str(key), str(cert), str(cert))
    args = build_parser().parse_args(["serve", "/m.gguf", "--load-format", "gguf"])
    assert engine_args_from(args, "/m.gguf").load_format == "gguf"


def test_every_flag_of_the_lists_is_a_serve_flag():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = set(serve._option_string_actions)
    for argv, *_ in HONOURED + REFUSED:
        for arg in argv:
            if arg.startswith("-") and not arg.lstrip("-")[:1].isdigit():
                name = arg.split(".")[0] if arg.startswith("-cc.") else arg
                assert name in known or name[:2] in known, name


def test_every_vllm_serve_option_is_honoured_or_refused_by_name(capsys):
    """The whole of `vllm serve --help=all` (vllm_serve_options): an option mrv2's parser takes
    is one of the cases above (honoured, or refused naming it); any other is refused by the
    parser, naming it and its vLLM group, never accepted and ignored."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    actions = serve._option_string_actions
    tested = {arg.split("=")[0] for argv, *_ in HONOURED + REFUSED for arg in argv
              if arg.startswith("-") and not arg.lstrip("-")[:1].isdigit()}
    # tested elsewhere: TLS files above, --model / --chat-template in test_cli_args.py,
    # --config in test_config_file.py
    tested |= {"--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--model", "--config",
               "--chat-template"}
    for group, options in VLLM_SERVE_OPTIONS.items():
        for option in options:
            if option in actions:
                assert tested & set(actions[option].option_strings), option
                continue
            with pytest.raises(SystemExit):
                build_parser().parse_args(["serve", "/m", option, "1"])
            err = capsys.readouterr().err
            assert f"{option} ({group})" in err and "unrecognized" not in err, err
