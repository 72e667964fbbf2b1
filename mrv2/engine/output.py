"""Front-end side of outputs: accumulate tokens per request and build RequestOutputs.

Text is decoded from the whole output when a RequestOutput is built, so multi-byte UTF-8
characters split across tokens come out whole. With `final_only` (the offline API's mode) that
happens once per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mrv2.outputs import CompletionOutput, RequestOutput
from mrv2.protocol import EngineCoreOutput, FinishReason
from mrv2.sampling_params import SamplingParams


@dataclass
class RequestTracker:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    final_only: bool
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestTracker] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, final_only: bool = True) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = RequestTracker(request_id, prompt, prompt_token_ids, params,
                                                   final_only)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        results = []
        for out in outputs:
            tracker = self.requests.get(out.request_id)
            if tracker is None:  # aborted by the front end while the core was stepping
                continue
            tracker.output_token_ids.extend(out.new_token_ids)
            if out.finished:
                tracker.finish_reason = out.finish_reason
                tracker.stop_reason = out.stop_reason
                del self.requests[out.request_id]
            if out.finished or not tracker.final_only:
                results.append(self._make_request_output(tracker))
        return results

    def _make_request_output(self, tracker: RequestTracker) -> RequestOutput:
        token_ids = list(tracker.output_token_ids)
        text = ""
        if self.tokenizer is not None and token_ids:
            text = self.tokenizer.decode(
                token_ids, skip_special_tokens=tracker.params.skip_special_tokens)
        finished = tracker.finish_reason is not None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids,
            finish_reason=str(tracker.finish_reason) if finished else None,
            stop_reason=tracker.stop_reason)
        return RequestOutput(request_id=tracker.request_id, prompt=tracker.prompt,
                             prompt_token_ids=tracker.prompt_token_ids, outputs=[completion],
                             finished=finished)
