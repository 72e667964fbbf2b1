"""EngineArgs.add_cli_args / from_cli_args (vLLM's): one flag per field, parsing to it."""

import argparse
import dataclasses

import pytest

from mrv2.engine.arg_utils import EngineArgs
from mrv2.models.builtin import builtin_model_path
from mrv2.utils import FlexibleArgumentParser


def parse(*argv: str) -> argparse.Namespace:
    return EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(list(argv))


def test_no_flags_give_the_fields_defaults_and_the_builtin_model():
    args = parse()
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name != "model"}
    assert {k: v for k, v in vars(args).items() if k != "model"} == fields
    assert args.model == str(builtin_model_path())


def test_each_kind_of_field_parses_to_its_value():
    args = parse("--model", "m", "--max-model-len", "128", "--kv-cache-memory-gb", "0.5",
                 "--no-async-scheduling", "--enforce-eager", "--dtype", "float32",
                 "--compilation-config", '{"cudagraph_mode": "NONE"}',
                 "--distributed-executor-backend", "mp")
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args == EngineArgs(
        model="m", max_model_len=128, kv_cache_memory_gb=0.5, async_scheduling=False,
        enforce_eager=True, dtype="float32", compilation_config={"cudagraph_mode": "NONE"},
        distributed_executor_backend="mp")


def test_an_argument_group_takes_the_flags_too():
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    assert EngineArgs.add_cli_args(group) is group
    assert parser.parse_args(["--max-num-seqs", "4"]).max_num_seqs == 4


@pytest.mark.parametrize("value", ["[1]", "nope"])
def test_a_config_flag_must_be_a_json_object(value, capsys):
    with pytest.raises(SystemExit):
        parse("--compilation-config", value)
    assert "--compilation-config" in capsys.readouterr().err
