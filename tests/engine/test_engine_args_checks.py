"""EngineArgs' checks of vLLM's options mrv2 takes as permissions or no-ops, and the refusal by
name of the ones it does not implement. No model is read: these checks run at construction."""

from __future__ import annotations

import inspect

import pytest

from mrv2.config import ConfigError
from mrv2.engine import engine_args_checks as checks
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.engine_args_checks import UnimplementedOptionError, check_generation_overrides

ACCEPTED = [
    {"trust_remote_code": True}, {"trust_remote_code": False},
    {"tokenizer_mode": "auto"}, {"tokenizer_mode": "hf"},
    {"load_format": "auto"}, {"load_format": "safetensors"},
    {"model": "/m.gguf", "load_format": "gguf"},
    {"swap_space": 0}, {"swap_space": 4}, {"swap_space": 4.0}, {"swap_space": None},
    {"hf_overrides": None}, {"hf_overrides": {}},  # vLLM's LLM passes {} for None
    {"optimization_level": 0}, {"optimization_level": 3}, {"compilation_config": 1},
    {"pipeline_parallel_size": 1, "data_parallel_size": 1}, {"scheduling_policy": "fcfs"},
    {"generation_config": "vllm"}, {"override_generation_config": {"temperature": 0.5}},
    {"disable_log_stats": True},
]
# (kwargs, the start of the message: the field, its value and its `mrv2 serve` flag).
REFUSED = [
    ({"trust_remote_code": "yes"}, "trust_remote_code='yes' (--trust-remote-code)"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' (--tokenizer-mode)"),
    ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow' (--tokenizer-mode)"),
    ({"load_format": "pt"}, "load_format='pt' (--load-format)"),
    ({"load_format": "gguf"}, "load_format='gguf' (--load-format)"),  # /m is no GGUF file
    ({"model": "/m.gguf", "load_format": "safetensors"}, "load_format='safetensors'"),
    ({"swap_space": 8}, "swap_space=8 (--swap-space)"),
    ({"hf_overrides": {"rope_theta": 1}}, "hf_overrides={'rope_theta': 1} (--hf-overrides)"),
    ({"optimization_level": 4}, "optimization_level=4 (--optimization-level)"),
    ({"optimization_level": True}, "optimization_level=True"),
    ({"compilation_config": 7}, "compilation_config=7 (--compilation-config)"),
    ({"scheduling_policy": "priority"}, "scheduling_policy='priority' (--scheduling-policy)"),
    ({"override_generation_config": {"do_sample": True}}, "override_generation_config="),
    ({"distributed_executor_backend": "external_launcher"},
     "distributed_executor_backend='external_launcher'"),
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=str)
def test_accepted_values_construct(kwargs):
    args = EngineArgs(**{"model": "/m", **kwargs})
    assert all(getattr(args, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[m for _, m in REFUSED])
def test_refused_values_name_the_field_and_flag(kwargs, message):
    with pytest.raises(ConfigError) as caught:
        EngineArgs(**{"model": "/m", **kwargs})
    assert str(caught.value).startswith(message), caught.value


def test_a_bad_generation_config_folder_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="generation-config"):
        EngineArgs(model="/m", generation_config=str(tmp_path / "none"))


@pytest.mark.parametrize("name, group", [
    ("cpu_offload_gb", "OffloadConfig"), ("disable_custom_all_reduce", "ParallelConfig"),
    ("hf_token", "ModelConfig"), ("mm_processor_kwargs", "MultiModalConfig"),
    ("enable_lora", "LoRAConfig"), ("max_seq_len_to_capture", "an earlier vLLM's"),
    *((name, "an earlier vLLM's") for name in checks.VLLM_EARLIER_ENGINE_ARGS),
])
def test_a_vllm_option_mrv2_lacks_is_refused_by_name(name, group):
    with pytest.raises(UnimplementedOptionError) as caught:
        EngineArgs(model="/m", **{name: 1})
    text = str(caught.value)
    assert text.startswith(f"{name}=1: mrv2 does not implement vLLM's {name}") and group in text
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, TypeError)


@pytest.mark.parametrize("name", ["max_model_lenn", "host", "api_key"])
def test_other_unknown_keywords_are_the_dataclass_type_error(name):
    # A typo, or one of `vllm serve`'s HTTP options (no vLLM engine argument either).
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'") as caught:
        EngineArgs(model="/m", **{name: 1})
    assert not isinstance(caught.value, UnimplementedOptionError)


def test_the_constructor_keeps_the_dataclass_signature():
    parameters = inspect.signature(EngineArgs).parameters
    assert list(parameters)[:2] == ["model", "dtype"] and "trust_remote_code" in parameters
    assert EngineArgs("/m", "float32").dtype == "float32"  # positional, as the dataclass


def test_generation_overrides_are_a_dict_of_numeric_sampling_fields():
    assert check_generation_overrides(None) == {}
    assert check_generation_overrides({"top_k": 5, "max_new_tokens": 9}) == \
        {"top_k": 5, "max_new_tokens": 9}
    for value, words in [([1], "give a dict"), ({"do_sample": True}, "do_sample"),
                         ({"temperature": "hot"}, "temperature must be numbers")]:
        with pytest.raises(ConfigError, match=words):
            check_generation_overrides(value)
