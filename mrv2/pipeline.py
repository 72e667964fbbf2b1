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
  (`share_sampled`); the other stages take them into their token history (`StageTokens`),
  without waiting for them, and answer nothing (the executor reads the last stage's output).

Micro-batches: with async scheduling the engine core keeps one step in flight per stage
(EngineConfig.max_steps_in_flight), each with its share of the requests, and gives a request
no new step while one of its steps is in flight (core/scheduler.py). So while the last stage
computes step N the first computes step N+1, whose requests do not need step N's tokens.

Layers that add their outputs into the stream themselves keep no residual; their stage sends
zeros in its place, which the next stage's first layer adds exactly (x + 0 = x).
"""

from __future__ import annotations

import re
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mrv2 import distributed

if TYPE_CHECKING:  # the runner's state, which imports this module
    from mrv2.inputs.batch import InputBatch
    from mrv2.protocol import SchedulerOutput
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


class StageTokens:
    """On a stage before the last: the last stage's sampled tokens, taken into this stage's
    per-slot state (state/requests.py) without waiting for them in the step that sampled them.

    `follow` (phase 2): the stage advances its counters at once, as its own sample would
    (num_computed, total_len; a 0 where the token goes), and posts the receipt of the last
    stage's broadcast. `settle` (before each phase 1): writes the tokens of every receipt but
    the newest `keep` into the history (token_ids, last_sampled). `keep` is the engine's steps
    in flight less one: under stages the scheduler gives a request no step while one of its
    steps is in flight, so a request's next step comes at least that many steps later. A
    request that leaves its slot (finished, aborted, preempted: the slot may be reused in
    this very step) settles every receipt first. SamplingStates are not followed: only the
    last stage samples.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        # (receipt, tokens [rows], rows that sampled, their slots, their token positions)
        self.pending: deque[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]] = deque()

    def follow(self, requests: RequestState, batch: InputBatch) -> None:
        rows, device = len(batch.req_ids), batch.idx_mapping.device
        requests.post_update(batch.idx_mapping, batch.num_scheduled,
                             torch.zeros(rows, dtype=torch.int64, device=device))
        sampling = requests.advance_num_computed_host(batch.idx_mapping_np,
                                                      batch.num_scheduled_np)
        slots = batch.idx_mapping_np[sampling]
        columns = np.minimum(requests.num_computed_host[slots], requests.max_model_len - 1)
        tokens = torch.empty(rows, dtype=torch.int64, device=device)
        receipt = distributed.broadcast_from_last_stage(tokens, async_op=True)
        self.pending.append((receipt, tokens, *(torch.from_numpy(np.asarray(a, np.int64)).to(
            device) for a in (np.flatnonzero(sampling), slots, columns))))

    def settle(self, requests: RequestState, step: SchedulerOutput) -> None:
        keep, leaving = self.keep, [*step.finished_req_ids, *step.preempted_req_ids]
        if leaving and self.pending:
            gone = {requests.req_id_to_slot.get(req_id) for req_id in leaving}
            if any(not gone.isdisjoint(p[3].tolist()) for p in self.pending):
                keep = 0
        while len(self.pending) > keep:
            receipt, tokens, rows, slots, columns = self.pending.popleft()
            receipt.wait()
            sampled = tokens[rows]
            requests.token_ids.tensor[slots, columns] = sampled.to(
                requests.token_ids.tensor.dtype)
            requests.last_sampled.tensor[slots] = sampled


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
