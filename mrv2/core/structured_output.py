"""Structured outputs in the engine core: compile grammars off the step path, advance each
request's matcher by its accepted tokens, fill the step's token bitmask.

The step's timeline (core/engine_core.py): the scheduler schedules step N+1, the worker starts
its forward, and meanwhile `grammar_output` fills the bitmask rows of N+1's constrained requests
from their matchers, which have accepted every token up to step N (with async scheduling the
core folds step N in first). The runner applies the mask before sampling, so a sampled token is
always one the matcher accepts.

Invariants:
- A request's matcher has accepted exactly its output tokens after the end of its reasoning
  (all of them without a reasoning parser), in order; tokens of a dropped step (preemption,
  abort) never reach it, because the scheduler drops them before `accept_token`.
- A request is not scheduled until its grammar has compiled (`RequestGrammar.is_ready`); one
  whose compile failed ends with finish_reason "error" and affects no other request.
- Compiles run one at a time on one background thread, so the step loop never waits for one.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from mrv2.config import ConfigError
from mrv2.protocol import GrammarOutput, SchedulerOutput

if TYPE_CHECKING:
    import xgrammar as xgr

    from mrv2.config import EngineConfig
    from mrv2.core.grammar import GrammarCompiler
    from mrv2.core.request import Request
    from mrv2.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

REASONING_END = "</think>"
REASONING_START = "<think>"


class RequestGrammar:
    """One request's grammar: a compile in flight, then a matcher."""

    def __init__(self, future: Future, prompt_token_ids: list[int]) -> None:
        self._future = future
        self._prompt_token_ids = prompt_token_ids
        self._matcher: xgr.GrammarMatcher | None = None
        self.reasoning_end_id: int | None = None
        self.reasoning_ended = True

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed): the scheduler may take the request."""
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        """The compile's failure, once done; None while compiling or when it succeeded."""
        return self._future.exception() if self._future.done() else None

    def start(self) -> None:
        """Create the matcher from the compiled grammar (once ready and without error). The
        reasoning ends in the prompt when the template closed it (e.g. thinking disabled)."""
        if self._matcher is not None:
            return
        import xgrammar as xgr

        compiled, start_id, end_id = self._future.result()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.reasoning_end_id = end_id
        if end_id is not None:
            prompt = self._prompt_token_ids
            last_end = _last_index(prompt, end_id)
            self.reasoning_ended = last_end > _last_index(prompt, start_id) and last_end >= 0
        self._prompt_token_ids = []

    @property
    def constrains_next(self) -> bool:
        """The next token is constrained: reasoning is over and the grammar is not done."""
        return self.reasoning_ended and not self._matcher.is_terminated()

    def accept_token(self, token_id: int) -> bool:
        """Advance by one output token; False if the grammar rejects it."""
        if not self.reasoning_ended:
            self.reasoning_ended = token_id == self.reasoning_end_id
            return True
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted its stop token: the request is complete."""
        return self._matcher is not None and self._matcher.is_terminated()

    def num_valid(self, drafts: list[int]) -> int:
        """How many of `drafts` (the tokens after the accepted ones) the grammar takes in a
        row: up to the first it rejects or the one that completes it; during reasoning, up to
        its end token (the grammar then starts, and it decides the rows after that token)."""
        if not self.reasoning_ended:
            end = self.reasoning_end_id
            return drafts.index(end) if end in drafts else len(drafts)
        matcher, count = self._matcher, 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            count += 1
        if count:
            matcher.rollback(count)
        return count

    def fill_bitmasks(self, bitmask: np.ndarray, row: int, drafts: list[int]) -> int:
        """The masks of the request's rows of this step from `row` on: the next token's, then
        the one after each draft (`num_valid` ones: the matcher advances through them, then
        rolls back), none after a draft that completes the grammar (the request ends there,
        dropping what follows); returns how many rows were filled."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(bitmask, row)
        filled = accepted = 1
        for token_id in drafts:
            if not matcher.accept_token(token_id):
                break
            accepted += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, row + filled)
            filled += 1
        if accepted > 1:
            matcher.rollback(accepted - 1)
        return filled


# vLLM's variable and default. Unbounded (xgrammar's default), a stream of distinct schemas
# (a fuzzer, per-user tool lists) grows the engine core's memory for as long as it runs.
XGRAMMAR_CACHE_MB_ENV = "VLLM_XGRAMMAR_CACHE_MB"
DEFAULT_XGRAMMAR_CACHE_MB = 512


def xgrammar_cache_limit_bytes() -> int:
    """The compiled-grammar cache's bound: $VLLM_XGRAMMAR_CACHE_MB MiB (default 512)."""
    text = os.environ.get(XGRAMMAR_CACHE_MB_ENV, str(DEFAULT_XGRAMMAR_CACHE_MB))
    try:
        megabytes = int(text)
    except ValueError:
        megabytes = -1
    if megabytes < 0:
        raise ConfigError(f"{XGRAMMAR_CACHE_MB_ENV}={text!r}: expected a number of MiB >= 0")
    return megabytes * 1024 * 1024


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._threads: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None  # made on the thread, on first use
        self._reasoning_ids: tuple[int | None, int | None] = (None, None)
        self._bitmask: np.ndarray | None = None  # [max_num_seqs, words], reused every step
        # Unfinished requests with a grammar: the step's bitmask is skipped while empty.
        self._num_live = 0
        self._cache_limit_bytes = xgrammar_cache_limit_bytes()  # a bad value fails start-up

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="mrv2-grammar-compile")
        future = self._threads.submit(self._compile, params)
        request.grammar = RequestGrammar(future, request.prompt_token_ids)
        self._num_live += 1

    @property
    def has_live_requests(self) -> bool:
        return self._num_live > 0

    def remove_request(self, request: Request) -> None:
        if request.grammar is not None:
            request.grammar = None
            self._num_live -= 1

    def grammar_output(self, scheduler_output: SchedulerOutput,
                       requests: dict[str, Request]) -> GrammarOutput:
        """The bitmask of the step's constrained rows, from matchers up to date with every
        token sampled before this step."""
        if not self._num_live or scheduler_output.is_empty:
            return GrammarOutput()
        if self._bitmask is None:
            import xgrammar as xgr

            spec = self.config.speculative_config  # a verify step's rows: one per draft more
            rows = self.config.scheduler_config.max_num_seqs * (
                1 + (0 if spec is None else spec.num_speculative_tokens))
            shape = xgr.get_bitmask_shape(rows, self.config.model_config.vocab_size)
            self._bitmask = np.empty(shape, dtype=np.int32)
        rows: list[int] = []
        bitmask = self._bitmask
        for row, req_id in enumerate(scheduler_output.req_ids):
            request = requests.get(req_id)
            grammar = None if request is None else request.grammar
            if grammar is not None and not request.is_finished and grammar.constrains_next:
                drafts = request.draft_token_ids[:request.num_scheduled_drafts]
                rows += [row] * grammar.fill_bitmasks(bitmask, len(rows), drafts)
        if not rows:
            return GrammarOutput()
        return GrammarOutput.build(rows, bitmask[:len(rows)])

    def shutdown(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

    # -- on the compile thread ------------------------------------------------------------

    def _compile(self, params: StructuredOutputsParams
                 ) -> tuple[xgr.CompiledGrammar, int | None, int | None]:
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return (self._compiler.compile(params), *self._reasoning_ids)

    def _make_compiler(self) -> GrammarCompiler:
        from mrv2.core.grammar import GrammarCompiler
        from mrv2.models.generation_config import eos_token_ids
        from mrv2.models.tokenizer import load_tokenizer

        model_config = self.config.model_config
        tokenizer = load_tokenizer(model_config.tokenizer_path)
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer, and it has none")
        stop_ids = eos_token_ids(model_config.hf_config, model_config.model,
                                 getattr(tokenizer, "eos_token_id", None))
        so_config = self.config.structured_outputs_config
        if so_config.reasoning_parser and not so_config.enable_in_reasoning:
            vocab = tokenizer.get_vocab()
            self._reasoning_ids = (vocab.get(REASONING_START), vocab.get(REASONING_END))
            if self._reasoning_ids[1] is None:
                logger.warning("reasoning_parser=%s: the tokenizer has no %s token; structured "
                               "outputs apply from the first token", so_config.reasoning_parser,
                               REASONING_END)
        return GrammarCompiler(tokenizer, model_config.vocab_size, list(stop_ids), so_config,
                               self._cache_limit_bytes)


def _last_index(token_ids: list[int], token_id: int | None) -> int:
    """Index of the last occurrence of token_id, -1 if absent (or token_id is None)."""
    if token_id is None:
        return -1
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] == token_id:
            return i
    return -1
