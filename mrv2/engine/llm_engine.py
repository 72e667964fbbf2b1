"""LLMEngine: tokenizer + input processing + engine core + output processing, in-process."""

from __future__ import annotations

import logging

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.core import EngineCore
from mrv2.engine.input_processor import InputProcessor, PromptType
from mrv2.engine.output import OutputProcessor
from mrv2.outputs import RequestOutput
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
                    final_only: bool = True) -> None:
        request, text = self.input_processor.process(request_id, prompt, params)
        self.output_processor.add_request(request_id, text, request.prompt_token_ids, params,
                                          final_only)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        return self.output_processor.process_outputs(outputs.outputs)

    def shutdown(self) -> None:
        self.engine_core.shutdown()
