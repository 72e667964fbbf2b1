"""PoolingParams: vLLM's fields, validated on construction; `verify` against the model."""

from __future__ import annotations

import pytest

from mrv2 import PoolingParams
from mrv2.pooling_params import engine_sampling_params
from mrv2.outputs import RequestOutputKind


@pytest.mark.parametrize("kwargs, field", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"dimensions": 0}, "dimensions"),
    ({"dimensions": True}, "dimensions"),
    ({"normalize": 1}, "normalize"),
    ({"task": "classify"}, "task"),
])
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=f"PoolingParams.{field}="):
        PoolingParams(**kwargs)


def test_verify_resolves_task_and_normalize():
    params = PoolingParams()
    resolved = params.verify("embed", 64, default_normalize=True)
    assert (resolved.task, resolved.normalize) == ("embed", True)
    assert params.task is None and params.normalize is None  # the caller's object is kept
    assert PoolingParams(normalize=False).verify("embed", 64, True).normalize is False
    assert PoolingParams().verify("embed", 64, False).normalize is False
    assert PoolingParams(dimensions=64).verify("embed", 64, True).dimensions == 64


def test_verify_refuses_what_the_model_cannot_do():
    with pytest.raises(ValueError, match="PoolingParams.dimensions=32 .*matryoshka.*64"):
        PoolingParams(dimensions=32).verify("embed", 64, True)
    with pytest.raises(ValueError, match="'token_embed' is not supported"):
        PoolingParams().verify("token_embed", 64, True)


def test_truncate_keeps_the_last_tokens():
    ids = list(range(10))
    assert PoolingParams().truncate(ids, 8) == ids
    assert PoolingParams(truncate_prompt_tokens=3).truncate(ids, 8) == [7, 8, 9]
    assert PoolingParams(truncate_prompt_tokens=-1).truncate(ids, 8) == ids[-7:]
    with pytest.raises(ValueError, match="greater than max_model_len=8"):
        PoolingParams(truncate_prompt_tokens=9).truncate(ids, 8)


def test_engine_runs_a_pooling_prompt_as_one_greedy_token():
    params = engine_sampling_params()
    assert params.max_tokens == 1 and params.sampling_type_greedy
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
