"""LLMEngine: tokenizer + input processing + engine core + output processing, in-process.

A request with `n > 1` fans out into n core requests `f"{i}_{request_id}"` sharing the prompt,
each with params `n=1` and seed `seed + i` (unseeded stays unseeded, so the samples differ);
the output processor gathers them back into one RequestOutput. Requests that the output
processor finishes on a stop string are aborted in the core at once, freeing their KV blocks;
their runner slots are freed by the core's next step.
"""

from __future__ import annotations

import logging

import msgspec

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.core import EngineCore
from mrv2.engine.input_processor import InputProcessor, PromptType
from mrv2.engine.output import OutputProcessor
from mrv2.outputs import RequestOutput, RequestOutputKind
from mrv2.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(model_path: str):
    """The model directory's tokenizer, or None when it has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:
        logger.warning("no tokenizer loaded from %s (%s); only token-id prompts will work",
                       model_path, error)
        return None


def child_sampling_params(params: SamplingParams) -> list[SamplingParams]:
    """Params of the n samples of one request: n=1 each, seeds seed+i when seeded."""
    if params.seed is None:
        child = params.clone(n=1)
        return [child] * params.n
    return [params.clone(n=1, seed=params.seed + i) for i in range(params.n)]


class LLMEngine:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.config = engine_args.create_engine_config()
        self.tokenizer = load_tokenizer(self.config.model_config.model)
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(self.config)

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
            for index, core_id in enumerate(core_ids):
                core_request = request
                if children is not None:
                    core_request = msgspec.structs.replace(
                        request, request_id=core_id, sampling_params=children[index])
                self.engine_core.add_request(core_request)
                added.append(core_id)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            self.engine_core.abort_requests(added)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort requests (a parent id aborts all its samples): frees their blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()
