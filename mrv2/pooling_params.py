"""PoolingParams: vLLM's parameters of a pooling (embedding) request, validated on construction.

A pooling request runs in the engine as a one-token greedy request (`engine_sampling_params`):
the scheduler, chunked prefill and preemption treat it like any other, and the runner of a
"pooling" engine pools each request's final-norm hidden states when its prefill completes
(mrv2/state/pooling.py). `verify` resolves a request's parameters against the model: the task,
`normalize` from the engine's pooler config, and `dimensions` (mrv2's decoders have no
matryoshka dimensions: only the hidden size itself is accepted).
"""

from __future__ import annotations

import msgspec

from mrv2.outputs import RequestOutputKind
from mrv2.sampling_params import SamplingParams

# vLLM's pooling tasks that a decoder converted to embedding serves.
POOLING_TASKS = ("embed",)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    # Keep only the last k prompt tokens (left truncation); -1: as many as the context takes.
    truncate_prompt_tokens: int | None = None
    # Size of the returned embedding; mrv2 returns the hidden size only (None: that size).
    dimensions: int | None = None
    # L2-normalise the embedding; None: the engine's pooler config says (default True).
    normalize: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        truncate, dimensions = self.truncate_prompt_tokens, self.dimensions
        if truncate is not None and (type(truncate) is not int
                                     or not (truncate == -1 or truncate >= 1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={truncate!r} is invalid: "
                             f"must be -1 (the model's context) or at least 1")
        if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions={dimensions!r} is invalid: must be a "
                             f"positive integer")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize={self.normalize!r} must be a boolean")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r}: a decoder converted to "
                             f"embedding serves {', '.join(map(repr, POOLING_TASKS))}")

    def clone(self, **changes) -> "PoolingParams":
        return msgspec.structs.replace(self, **changes)

    def verify(self, task: str, hidden_size: int, default_normalize: bool) -> "PoolingParams":
        """These params resolved for `task` on a model of `hidden_size` whose pooler config
        normalises by `default_normalize` (a new object; ValueError naming a bad field)."""
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling task {task!r} is not supported: a decoder converted to "
                             f"embedding serves {', '.join(map(repr, POOLING_TASKS))}")
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams.task={self.task!r} cannot be used for the "
                             f"{task!r} task")
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(f"PoolingParams.dimensions={self.dimensions} is not supported: "
                             f"the model has no matryoshka dimensions, its embeddings have "
                             f"{hidden_size} (leave dimensions unset)")
        normalize = default_normalize if self.normalize is None else self.normalize
        return self.clone(task=task, normalize=normalize)

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` ids (-1: the most a prompt may have)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        if keep == -1:
            keep = max_model_len - 1  # a prompt leaves one position (the engine's one step)
        elif keep > max_model_len:
            raise ValueError(f"PoolingParams.truncate_prompt_tokens={keep} is greater than "
                             f"max_model_len={max_model_len}; select a smaller truncation size")
        return token_ids[-keep:]


def engine_sampling_params() -> SamplingParams:
    """What a pooling request runs as in the engine: one greedy token, which nobody sees."""
    return SamplingParams(temperature=0.0, max_tokens=1,
                          output_kind=RequestOutputKind.FINAL_ONLY)
