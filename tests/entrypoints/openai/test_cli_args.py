"""`mrv2 serve` flags -> EngineArgs and ServerConfig (vLLM's names and defaults)."""

from __future__ import annotations

import pytest

from mrv2.entrypoints.cli import build_parser, main
from mrv2.entrypoints.openai.cli_args import (API_KEY_ENV, engine_args_from, resolve_model,
                                              server_config_from)


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults():
    args = parse("/m")
    assert resolve_model(args) == "/m"
    config = server_config_from(args, "/m")
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None)
    assert config.served_model_names == ["/m"] and config.model_name == "/m"
    assert config.generation_config == "auto" and config.chat_template is None
    engine = engine_args_from(args, "/m")
    # Prefix caching: None is "on, unless MEAN pooling" (EngineArgs decides).
    # async_scheduling: None is "on, unless speculative decoding" (EngineArgs decides).
    assert engine.enable_prefix_caching is None and engine.async_scheduling is None
    assert (engine.runner, engine.convert, engine.pooler_config) == ("auto", "auto", None)
    assert not engine.enforce_eager and engine.tensor_parallel_size == 1
    # vLLM's defaults: context and batched tokens from the model / scheduler, 256 sequences,
    # 16-token blocks, dtype from the checkpoint, seed 0.
    assert (engine.max_model_len, engine.max_num_batched_tokens) == (None, None)
    assert (engine.max_num_seqs, engine.block_size, engine.dtype, engine.seed) == \
        (256, 16, "auto", 0)
    assert args.tensor_parallel_size == parse("/m", "-tp", "1").tensor_parallel_size


def test_vllm_flag_names(tmp_path, monkeypatch):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    args = parse("--model", "/m", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
                 "--served-model-name", "a", "b", "--tensor-parallel-size", "2",
                 "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens",
                 "128", "--block-size", "32", "--no-enable-prefix-caching", "--dtype",
                 "float32", "--seed", "5", "--enforce-eager", "--no-async-scheduling",
                 "--chat-template", str(template), "--generation-config", "vllm")
    model = resolve_model(args)
    config = server_config_from(args, model)
    assert (model, config.host, config.port, config.api_key) == ("/m", "0.0.0.0", 9000, "k")
    assert config.served_model_names == ["a", "b"] and config.model_name == "a"
    assert config.chat_template == "{{ messages }}" and config.generation_config == "vllm"
    engine = engine_args_from(args, model)
    assert (engine.tensor_parallel_size, engine.max_model_len, engine.max_num_seqs) == (2, 64, 4)
    assert (engine.max_num_batched_tokens, engine.block_size, engine.seed) == (128, 32, 5)
    assert engine.dtype == "float32" and engine.enforce_eager
    assert not engine.enable_prefix_caching and not engine.async_scheduling
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config_from(parse("/m"), "/m").api_key == "from-env"


def test_bad_flags_are_clear_errors(tmp_path, capsys):
    with pytest.raises(ValueError, match="no such file"):
        server_config_from(parse("/m", "--chat-template", "missing.jinja"), "/m")
    assert server_config_from(parse("/m", "--chat-template", "{{ x }}"), "/m").chat_template \
        == "{{ x }}"
    with pytest.raises(ValueError, match="two models"):
        server_config_from(parse("/a", "--model", "/b"), "/a")
    with pytest.raises(ValueError, match="generation-config"):
        server_config_from(parse("/m", "--generation-config", "bogus"), "/m")
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text("{}")
    assert server_config_from(parse("/m", "--generation-config", str(tmp_path / "gen")),
                              "/m").generation_config == str(tmp_path / "gen")
    code = main(["serve", str(tmp_path / "missing")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("mrv2: error: ") and "Traceback" not in err


def test_builtin_model_is_the_default_and_answers_to_a_short_name(capsys):
    from mrv2.models.builtin import BUILTIN_SERVED_NAME, builtin_model_path

    args = parse()
    model = resolve_model(args)
    assert model == str(builtin_model_path())
    assert "Using the built-in model" in capsys.readouterr().out
    config = server_config_from(args, model)
    assert config.served_model_names == [BUILTIN_SERVED_NAME, model]
    assert config.model_name == BUILTIN_SERVED_NAME
