"""Pipeline parallelism: which decoder layers a stage holds, and what passes between stages.

A model of L layers on P stages: stage s holds a contiguous run of them (`stage_layers`, L // P
each; the remainder goes one each to the stages before the last, which also computes the LM
head and samples, as vLLM splits). The other layers are `MissingLayer`s: no parameters, no KV
cache. The first stage holds the embedding, the last the final norm and the LM head.

A step, on every rank (all run the same scheduler output, so their per-slot state stays in
step):
- phase 1: the first stage embeds; every later stage receives the previous stage's hidden
  states and residual stream (`receive_stream`, [tokens, hidden] each, from the same
  tensor-parallel rank); each stage runs its layers; every stage but the last sends its stream
  on (`send_stream`);
- phase 2: the last stage samples and broadcasts the sampled tokens to the world
  (`share_sampled`); the other stages take them (`follow_sampled`) into their token history,
  as a step's own sample would, and answer nothing (the executor reads the last stage's
  output).

Layers that add their outputs into the stream themselves keep no residual; their stage sends
zeros in its place, which the next stage's first layer adds exactly (x + 0 = x).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from mrv2 import distributed

if TYPE_CHECKING:  # the runner's state, which imports this module
    from mrv2.inputs.batch import InputBatch
    from mrv2.sampler import SamplingStates
    from mrv2.state.requests import RequestState


def stage_layers(num_layers: int, stage: int | None = None, num_stages: int | None = None
                 ) -> range:
    """The layers of `stage` of `num_stages` (default: this process's stage)."""
    stage = distributed.get_pp_rank() if stage is None else stage
    num_stages = distributed.get_pp_size() if num_stages is None else num_stages
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):  # the stages before the last, last first
        sizes[-2 - i % (num_stages - 1)] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


class MissingLayer(nn.Module):
    """A decoder layer another stage holds: no parameters here, never called here."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("a layer of another pipeline stage was called on this one")


def receive_stream(num_tokens: int, hidden_size: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states, residual stream) [num_tokens, hidden_size] from the previous stage."""
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    residual = torch.empty_like(hidden)
    distributed.pp_recv([hidden, residual])
    return hidden, residual


def send_stream(hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
    distributed.pp_send([hidden, torch.zeros_like(hidden) if residual is None else residual])


def share_sampled(sampled: torch.Tensor) -> None:
    """On the last stage: the step's sampled tokens [rows] int64, to every other stage."""
    if distributed.get_pp_size() > 1:
        distributed.broadcast_from_last_stage(sampled)


def follow_sampled(requests: RequestState, sampling: SamplingStates, batch: InputBatch,
                   positions: torch.Tensor) -> None:
    """On a stage before the last: the last stage's sampled tokens, taken into this stage's
    per-slot state as its own sample would be (state/requests.py, sampler/states.py)."""
    sampled = torch.empty(len(batch.req_ids), dtype=torch.int64, device=positions.device)
    distributed.broadcast_from_last_stage(sampled)
    requests.post_update(batch.idx_mapping, batch.num_scheduled, sampled)
    sampling.post_update(batch.idx_mapping, batch.idx_mapping_np, positions, sampled)
    requests.advance_num_computed_host(batch.idx_mapping_np, batch.num_scheduled_np)


_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def held_by_stage(model: nn.Module, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to what this stage holds: its layers, and the
    embedding and LM head where it has them. Every other name is this stage's to load (or to
    refuse, by name, when the model has no such parameter)."""
    if distributed.get_pp_size() == 1:
        return True
    inner = model.model
    match = _LAYER_NAME.search(name)
    if match is not None and int(match.group(1)) < len(inner.layers):
        return not isinstance(inner.layers[int(match.group(1))], MissingLayer)
    if name.startswith("model.embed_tokens."):
        return inner.embed_tokens is not None
    if name.startswith("lm_head."):
        return getattr(model, "lm_head", None) is not None
    return True
