"""LLMEngine: tokenizer + input processing + engine core + output processing, in-process.

A request with `n > 1` fans out into n core requests `f"{i}_{request_id}"` sharing the prompt,
each with params `n=1` and seed `seed + i` (unseeded stays unseeded, so the samples differ);
the output processor gathers them back into one RequestOutput. Requests that the output
processor finishes on a stop string are aborted in the core at once, freeing their KV blocks;
their runner slots are freed by the core's next step.

The engine core runs in this process (`InprocClient`, the offline default) or, with
`multiprocess_core=True`, in its own process (`MPClient`): the core then steps on its own while
this process tokenizes and detokenizes. `engine_core` is the in-process EngineCore (None with a
core process); `core_client` is the client either way. With a core process a request the core
refuses raises `RequestRejectedError` from `step()` rather than from `add_request()`.
"""

from __future__ import annotations

import msgspec

from mrv2.core.engine_core import EngineCore
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.client import InprocClient, MPClient, RequestRejectedError
from mrv2.engine.input_processor import InputProcessor, PromptType
from mrv2.engine.output_processor import OutputProcessor
from mrv2.models.tokenizer import load_tokenizer
from mrv2.outputs import RequestOutput, RequestOutputKind
from mrv2.protocol import EngineCoreRequest
from mrv2.sampling_params import SamplingParams


def child_sampling_params(params: SamplingParams) -> list[SamplingParams]:
    """Params of the n samples of one request: n=1 each, seeds seed+i when seeded."""
    if params.seed is None:
        child = params.clone(n=1)
        return [child] * params.n
    return [params.clone(n=1, seed=params.seed + i) for i in range(params.n)]


def core_requests(request: EngineCoreRequest, core_ids: list[str],
                  children: list[SamplingParams] | None) -> list[EngineCoreRequest]:
    """What the core receives for one user request: itself, or one request per sample of
    n > 1 (ids `core_ids`, params `children`)."""
    if children is None:
        return [request]
    return [msgspec.structs.replace(request, request_id=core_id, sampling_params=child)
            for core_id, child in zip(core_ids, children)]


def user_request_id(output_processor: OutputProcessor, core_request_id: str) -> str:
    """The user's request id of a core request (its parent's, for a sample of n > 1)."""
    state = output_processor.requests.get(core_request_id)
    if state is not None and state.parent is not None:
        return state.parent.request_id
    return core_request_id


class LLMEngine:
    def __init__(self, engine_args: EngineArgs, multiprocess_core: bool = False) -> None:
        self.config = engine_args.create_engine_config()
        if multiprocess_core:
            # Started first: the tokenizer loads while the core process starts.
            self.core_client = MPClient(self.config)
            self.engine_core: EngineCore | None = None
        else:
            self.core_client = InprocClient(self.config)
            self.engine_core = self.core_client.engine_core
        try:
            self.tokenizer = load_tokenizer(self.config.model_config.tokenizer_path)
        except BaseException:
            self.core_client.shutdown()
            raise
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)

    def validate_request(self, request_id: str, prompt: PromptType, params: SamplingParams):
        """All checks of `add_request` without adding anything."""
        return self.input_processor.process(request_id, prompt, params)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        """Queue a request. Its RequestOutputs come from `step()`, streamed per `output_kind`.

        On any error nothing of the request stays behind, in the front end or in the core.
        """
        request, text = self.input_processor.process(request_id, prompt, params)
        children = child_sampling_params(params) if params.n > 1 else None
        core_ids = self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, params, output_kind, children)
        added: list[str] = []
        try:
            for core_request in core_requests(request, core_ids, children):
                self.core_client.add_request(core_request)
                added.append(core_request.request_id)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            if added and not self.core_client.is_dead:
                self.core_client.abort_requests(added)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (a parent id aborts all its samples): frees their blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core_client.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """In process: run one core step. With a core process: wait for its next outputs
        (without waiting when no request is unfinished)."""
        timeout = None if self.output_processor.has_unfinished_requests() else 0
        try:
            outputs = self.core_client.get_output(timeout)
        except RequestRejectedError as error:
            self.abort_request([user_request_id(self.output_processor, error.request_id)])
            raise
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.core_client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def drain(self) -> None:
        """In process: run the few empty steps that free the runner slots of finished and
        aborted requests and retire steps in flight, now rather than at the next call. A core
        process does this on its own."""
        core = self.engine_core
        if core is None:
            return
        for _ in range(2 + core.max_steps_in_flight):
            if not core.has_unfinished_requests():
                break
            self.step()

    def get_stats(self):
        """The core's scheduler stats (mrv2.protocol.CoreStats)."""
        return self.core_client.get_stats()

    def shutdown(self) -> None:
        self.core_client.shutdown()
