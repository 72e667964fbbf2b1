"""AsyncOutput: the one device-to-host copy of a step (DESIGN.md invariant 4).

On CUDA the sampled ids are copied into pinned host memory on a dedicated copy stream, after
the compute stream's work so far, with a fresh event per step; `get_output()` waits on that
event only. The device tensor is kept referenced (and recorded on the copy stream) until the
copy is done, so the caching allocator cannot hand its memory to the next step early. On CPU
the sampled tensor already is host memory and is read directly.

The step's logprobs (sampled tokens' and, when some request asked, prompt positions') and, on
a pooling runner, the rows' pooled hidden states (float32; only the rows that completed their
prefill are reported) ride on the same copy.

It is the executor's `Deferred`: the worker returns it from phase 2 without waiting, and the
executor's reply thread calls `resolve()` (the event is a blocking one, so that thread sleeps
instead of spinning on a core the worker's main loop needs for step N+1).
"""

from __future__ import annotations

import numpy as np
import torch

from executor.deferred import Deferred
from executor.packed import int32_bytes, ones_int32_bytes, pack_ids
from mrv2.protocol import ModelRunnerOutput, PromptLogprobsChunk, SampledTokenLogprobs
from mrv2.sampler.logprobs import LogprobsTensors


class AsyncOutput(Deferred[ModelRunnerOutput]):
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, is_sampling: np.ndarray,
                 copy_stream: "torch.cuda.Stream | None" = None, *,
                 logprobs: LogprobsTensors | None = None,
                 num_logprobs: np.ndarray | None = None,
                 prompt_logprobs: dict[str, tuple[int, LogprobsTensors]] | None = None,
                 nan_rows: torch.Tensor | None = None,
                 pooled: torch.Tensor | None = None, num_sampled: np.ndarray | None = None,
                 drafts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
        """``sampled``: [B] int64, or [B, steps] for a run of decode steps (runner.py), or
        [B, width] of which row b's first ``num_sampled[b]`` are its tokens (speculative
        decoding's verify steps, with ``drafts``: (each row's count of next drafts [B], the
        drafts, flat, row after row, each row's pause [B]: DraftState.written); the
        ``logprobs`` then hold a row per token, request after request).
        ``prompt_logprobs``: req_id -> (first prompt position, rows), see
        sampler/prompt_logprobs.py. ``nan_rows``: [B] bool, rows whose logits held a NaN
        (their requests are reported in ``nan_req_ids``). ``pooled``: [B, hidden] float32
        (state/pooling.py)."""
        self.req_ids = req_ids
        self.is_sampling = is_sampling
        self.num_logprobs = num_logprobs
        self.num_sampled, self.drafts = num_sampled, drafts
        self._event = None
        self._cuda_device = sampled.device  # the device a resolving thread must make current
        if nan_rows is None:
            nan_rows = torch.zeros(sampled.shape[0], dtype=torch.bool, device=sampled.device)
        device_tensors = [sampled, nan_rows]
        if logprobs is not None:
            device_tensors += [logprobs.token_ids, logprobs.logprobs, logprobs.ranks]
        self._prompt_starts: dict[str, int] | None = None
        if prompt_logprobs:
            self._prompt_starts = {req_id: start for req_id, (start, _) in prompt_logprobs.items()}
            for _, t in prompt_logprobs.values():
                device_tensors += [t.token_ids, t.logprobs, t.ranks]
        num_prompt_end = len(device_tensors)
        if pooled is not None:
            device_tensors.append(pooled)
        if sampled.device.type == "cuda":
            assert copy_stream is not None, "a CUDA output needs a copy stream"
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                     for t in device_tensors]
            copy_stream.wait_stream(torch.cuda.current_stream(sampled.device))
            with torch.cuda.stream(copy_stream):
                for host, t in zip(hosts, device_tensors):
                    host.copy_(t, non_blocking=True)
                    t.record_stream(copy_stream)
                self._event = torch.cuda.Event(blocking=True)
                self._event.record(copy_stream)
            self._device = device_tensors  # alive until the copy completes
        else:
            hosts = device_tensors
            self._device = None
        self._sampled_host, self._nan_host = hosts[0], hosts[1]
        num_sample = 0 if logprobs is None else 3
        self._logprobs = None if logprobs is None else LogprobsTensors(*hosts[2:5])
        # 3 tensors per request, in dict order
        self._prompt_hosts = hosts[2 + num_sample:num_prompt_end]
        self._pooled_host = hosts[-1] if pooled is not None else None

    @property
    def copy_in_flight(self) -> bool:
        """A device-to-host copy to wait for (CUDA); on the CPU the output is ready now."""
        return self._event is not None

    def resolve(self) -> ModelRunnerOutput:
        """`get_output()` from another thread (the executor's reply thread)."""
        if self._event is not None:
            torch.cuda.set_device(self._cuda_device)
        return self.get_output()

    def get_output(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
            self._device = None
        # Token ids are below the vocabulary size: int32 holds them (no overflow check, which
        # would cost more than the rest of this method on a 256-row step).
        host = self._sampled_host.numpy()
        tokens = host.reshape(-1).astype(np.int32)
        # One token per sampling row, or one per decode step of a run of them ([rows, steps]:
        # every row samples); a prefill chunk that did not finish its prompt has none.
        if self.num_sampled is not None:
            counts = np.asarray(self.num_sampled, np.int32)
            sampled = host[np.arange(host.shape[1]) < counts[:, None]].astype(np.int32)
            num_sampled = int32_bytes(counts)
        elif host.ndim == 2:
            sampled, num_sampled = tokens, int32_bytes(np.full(len(host), host.shape[1], np.int32))
        elif self.is_sampling.all():  # the common case: every row samples
            sampled, num_sampled = tokens, ones_int32_bytes(len(tokens))
        else:
            sampled = tokens[self.is_sampling]
            num_sampled = int32_bytes(self.is_sampling.astype(np.int32))
        logprobs = None
        if self._logprobs is not None:
            assert self.num_logprobs is not None
            # Rows that sampled nothing (a prefill chunk) report no logprobs either.
            num = np.where(self.is_sampling, self.num_logprobs, -1)
            if self.num_sampled is None:
                logprobs = [None if row is None else [SampledTokenLogprobs(*row)]
                            for row in self._logprobs.to_lists(num)]
            else:  # the logprobs rows are the requests' tokens, request after request
                logprobs = _grouped(self._logprobs.to_lists(np.repeat(num, self.num_sampled)),
                                    self.num_sampled)
        prompt = None
        if self._prompt_starts is not None:
            hosts = self._prompt_hosts
            prompt = {req_id: PromptLogprobsChunk(start, hosts[3 * i].tolist(),
                                                  hosts[3 * i + 1].tolist(),
                                                  hosts[3 * i + 2].tolist())
                      for i, (req_id, start) in enumerate(self._prompt_starts.items())}
        nan_req_ids: list[str] = []
        nan = self._nan_host.numpy()
        if nan.any():  # rare: a list only then
            nan_req_ids = [self.req_ids[i] for i in np.flatnonzero(nan & self.is_sampling)]
        pooled = None
        if self._pooled_host is not None:
            rows = self._pooled_host.numpy()
            pooled = {self.req_ids[i]: rows[i].tobytes()
                      for i in np.flatnonzero(self.is_sampling)}
        return ModelRunnerOutput(pack_ids(self.req_ids), len(self.req_ids), int32_bytes(sampled),
                                 num_sampled, logprobs=logprobs,
                                 prompt_logprobs=prompt, nan_req_ids=nan_req_ids,
                                 pooled=pooled, **({} if self.drafts is None else dict(
                                     num_draft_tokens_i32=int32_bytes(self.drafts[0]),
                                     draft_token_ids_i32=int32_bytes(self.drafts[1]),
                                     draft_pauses_i32=int32_bytes(self.drafts[2]))))


def _grouped(rows: list, counts: np.ndarray) -> list[list[SampledTokenLogprobs] | None]:
    """Per request, its `counts[r]` rows' logprobs (None for a request that asked for none)."""
    out: list[list[SampledTokenLogprobs] | None] = []
    start = 0
    for count in counts.tolist():
        group = rows[start:start + count]
        start += count
        out.append(None if not group or group[0] is None
                   else [SampledTokenLogprobs(*row) for row in group])
    return out
