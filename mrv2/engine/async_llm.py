"""AsyncLLM: the asyncio front end over an engine-core process (vLLM v1's AsyncLLM).

Tokenization (`InputProcessor`) and detokenization with stop strings (`OutputProcessor`) run
in this process, on the event loop, while the core process runs its step loop. One output
handler task takes every EngineCoreOutputs from the `AsyncMPClient`, turns it into
RequestOutputs and hands each to its request's `RequestStream`; `generate()` iterates its
stream. A slow consumer does not make a stream grow: CUMULATIVE keeps only the latest output
and DELTA outputs are merged until taken.

- Completions ended by a stop string here are aborted in the core by the handler.
- `abort(request_id)` frees the request in the core; its `generate()` ends with a final output
  whose unfinished completions have finish_reason "abort".
- A `generate()` whose consumer goes away (task cancelled, e.g. a client disconnect, or the
  iterator closed early) aborts its request in the core.
- If the core process dies, every `generate()` raises `EngineDeadError` and so does every later
  call; `errored` turns True. Build a new AsyncLLM to recover.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from mrv2.config import EngineConfig
from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.async_client import AsyncMPClient
from mrv2.engine.client import DEFAULT_STARTUP_TIMEOUT_S, RequestRejectedError
from mrv2.engine.dp_client import DPAsyncClient
from mrv2.engine.input_processor import InputProcessor, PromptType
from mrv2.engine.llm_engine import child_sampling_params, core_requests, user_request_id
from mrv2.engine.output_processor import OutputProcessor
from mrv2.errors import EngineDeadError
from mrv2.models.tokenizer import load_tokenizer
from mrv2.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput, RequestOutputKind
from mrv2.pooling_params import PoolingParams
from mrv2.protocol import CoreStats
from mrv2.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Core outputs handled per slice before yielding to the event loop, so that a large batch does
# not stall other tasks (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_CHUNK_SIZE = 128


class RequestStream:
    """The outputs of one request not yet taken by its `generate()`, or the error ending it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 output_kind: RequestOutputKind, n: int) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.output_kind, self.n = output_kind, n
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.finished = False  # the final output was put
        self._event = asyncio.Event()
        self._latest: dict[int, CompletionOutput] = {}  # per index (CUMULATIVE)
        self._done: set[int] = set()  # indices whose completion finished

    def put(self, output: RequestOutput | PoolingRequestOutput) -> None:
        if isinstance(output, PoolingRequestOutput):  # a pooling request's one output
            self.pending, self.finished = output, True
            self._event.set()
            return
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self._done.add(completion.index)
            if self.output_kind == RequestOutputKind.CUMULATIVE:
                self._latest[completion.index] = completion
        if self.pending is not None and self.output_kind == RequestOutputKind.DELTA:
            output = _merge_delta(self.pending, output)
        self.pending = output
        self.finished = output.finished
        self._event.set()

    def put_error(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def put_aborted(self) -> None:
        """End the stream: the unfinished completions finish with reason "abort"."""
        if self.output_kind == RequestOutputKind.CUMULATIVE:
            completions = [self._latest.get(i) or CompletionOutput(index=i, text="", token_ids=[])
                           for i in range(self.n)]
        else:
            completions = [CompletionOutput(index=i, text="", token_ids=[])
                           for i in range(self.n) if i not in self._done]
        for completion in completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        self.put(RequestOutput(request_id=self.request_id, prompt=self.prompt,
                               prompt_token_ids=self.prompt_token_ids, outputs=completions,
                               finished=True))

    async def get(self) -> RequestOutput:
        while self.pending is None:
            if self.error is not None:
                raise self.error
            self._event.clear()
            await self._event.wait()
        output, self.pending = self.pending, None
        return output


def _merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in old.outputs}
    for completion in new.outputs:
        prior = by_index.get(completion.index)
        if prior is None:
            by_index[completion.index] = completion
            continue
        prior.text += completion.text
        prior.token_ids = prior.token_ids + completion.token_ids
        if prior.logprobs is not None or completion.logprobs is not None:
            prior.logprobs = (prior.logprobs or []) + (completion.logprobs or [])
        prior.cumulative_logprob = completion.cumulative_logprob
        prior.finish_reason, prior.stop_reason = completion.finish_reason, completion.stop_reason
    old.outputs = sorted(by_index.values(), key=lambda c: c.index)
    if old.prompt_logprobs is None:
        old.prompt_logprobs = new.prompt_logprobs
    old.finished = new.finished
    return old


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, executor_class: type | None = None,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> None:
        self.config = config
        # Start the core first: the tokenizer loads here while the core process starts.
        # Data parallelism: several cores behind one client (mrv2/engine/dp_client.py).
        client = (DPAsyncClient if config.parallel_config.data_parallel_size > 1
                  else AsyncMPClient)
        self.engine_core: AsyncMPClient | DPAsyncClient = client(
            config, executor_class=executor_class, startup_timeout_s=startup_timeout_s)
        try:
            self.tokenizer = load_tokenizer(config.model_config.tokenizer_path)
            self.input_processor = InputProcessor(config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self._streams: dict[str, RequestStream] = {}
        self._output_handler: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._closed = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        return cls(engine_args.create_engine_config(), **kwargs)

    # -- state -------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self._error is not None or self.engine_core.is_dead

    @property
    def is_running(self) -> bool:
        handler = self._output_handler
        return not self._closed and not self.errored and (handler is None or not handler.done())

    @property
    def dead_error(self) -> EngineDeadError:
        reason = self.engine_core.dead_reason or str(self._error or "the engine is not running")
        return EngineDeadError(reason)

    def _check_running(self) -> None:
        if self.errored or self._closed:
            raise self.dead_error

    def get_tokenizer(self):
        return self.tokenizer

    # -- requests ----------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams | PoolingParams,
                          output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                          ) -> RequestStream:
        """Validate, tokenize and send a request (PoolingParams: a pooling one, on a pooling
        engine); returns its stream. Raises on a bad request (nothing of it stays behind) or a
        dead engine."""
        self._check_running()
        self._ensure_output_handler()
        output_kind = RequestOutputKind(output_kind)
        pooling = None
        if isinstance(sampling_params, PoolingParams):
            pooling = sampling_params = self.input_processor.resolve_pooling(sampling_params)
        request, text = self.input_processor.process(request_id, prompt, sampling_params)
        sampling_params = request.sampling_params  # pooling: the engine's one-token params
        children = child_sampling_params(sampling_params) if sampling_params.n > 1 else None
        core_ids = self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, sampling_params, output_kind, children,
            pooling=pooling)
        stream = RequestStream(request_id, text, request.prompt_token_ids, output_kind,
                               sampling_params.n)
        self._streams[request_id] = stream
        sent: list[str] = []
        try:
            for core_request in core_requests(request, core_ids, children, output_kind):
                await self.engine_core.add_request_async(core_request)
                sent.append(core_request.request_id)
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort_requests([request_id])
            if sent and not self.engine_core.is_dead:
                await self.engine_core.abort_requests_async(sent)
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str,
                       output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs (per `output_kind`); the last has finished=True.

        Leaving early (cancellation, closing the iterator) aborts the request in the core."""
        stream = await self.add_request(request_id, prompt, sampling_params, output_kind)
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            # Cancelled, closed early, or failed: free the request in the core. (A dead
            # engine or a request it refused has nothing left to free.)
            if not stream.finished and self._streams.get(request_id) is stream:
                await self._abort([request_id], notify=False)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's: a pooling request's one PoolingRequestOutput (`outputs.data` None when the
        engine failed it). Leaving early aborts it, as `generate`."""
        async for output in self.generate(prompt, pooling_params, request_id,
                                          RequestOutputKind.FINAL_ONLY):
            yield output

    async def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (a parent id aborts all its samples); unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await self._abort(ids, notify=True)

    async def _abort(self, request_ids: list[str], notify: bool) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None and notify:
                stream.put_aborted()
        if core_ids and not self.engine_core.is_dead:
            await self.engine_core.abort_requests_async(core_ids)

    # -- outputs -----------------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        handler = self._output_handler
        loop = asyncio.get_running_loop()
        if handler is None or handler.done() or handler.get_loop() is not loop:
            self._output_handler = loop.create_task(self._run_output_handler(),
                                                    name="mrv2-async-llm-output")

    async def _run_output_handler(self) -> None:
        client, processor = self.engine_core, self.output_processor
        try:
            while True:
                try:
                    outputs = (await client.get_output_async()).outputs
                except RequestRejectedError as error:
                    self._reject(error)
                    continue
                for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
                    if start:
                        await asyncio.sleep(0)
                    processed = processor.process_outputs(outputs[start:start + OUTPUT_CHUNK_SIZE])
                    for output in processed.request_outputs:
                        stream = self._streams.get(output.request_id)
                        if stream is None:
                            continue
                        stream.put(output)
                        if output.finished:
                            del self._streams[output.request_id]
                    if processed.reqs_to_abort:
                        await client.abort_requests_async(processed.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            if not isinstance(error, EngineDeadError):
                logger.exception("AsyncLLM output handler failed")
            self._error = error
            dead = self.dead_error
            for stream in self._streams.values():
                stream.put_error(dead)
            self._streams.clear()

    def _reject(self, error: RequestRejectedError) -> None:
        request_id = user_request_id(self.output_processor, error.request_id)
        core_ids = self.output_processor.abort_requests([request_id])
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put_error(error)
        if core_ids:  # the other samples of an n > 1 request (unknown ids are ignored)
            self._background(self.engine_core.abort_requests_async(core_ids))

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # a reference until it is done

        def done(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                logger.debug("AsyncLLM background task failed: %r", task.exception())

        task.add_done_callback(done)

    # -- utilities and shutdown --------------------------------------------------------------

    async def get_stats(self) -> CoreStats:
        """The core's scheduler stats: running / waiting requests, KV usage, prefix cache
        (under data parallelism, the cores' together)."""
        self._check_running()
        return await self.engine_core.get_stats_async()

    async def get_engine_stats(self) -> list[CoreStats]:
        """Each engine core's stats, by data-parallel index (one without data parallelism)."""
        self._check_running()
        if isinstance(self.engine_core, DPAsyncClient):
            return await self.engine_core.get_engine_stats_async()
        return [await self.engine_core.get_stats_async()]

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (EngineCore.sleep): level 1 frees the KV cache, 2 the weights too."""
        self._check_running()
        await self.engine_core.call_utility_async("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._check_running()
        await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        self._check_running()
        return bool(await self.engine_core.call_utility_async("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's); False, doing nothing, while a request holds
        blocks."""
        self._check_running()
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    def shutdown(self) -> None:
        """Stop the core process; requests still streaming get EngineDeadError. Idempotent."""
        if self._closed:
            return
        self._closed = True
        handler = self._output_handler
        if handler is not None and not handler.done():
            try:
                if asyncio.get_running_loop() is handler.get_loop():
                    handler.cancel()
            except RuntimeError:
                pass
        self.engine_core.shutdown()
        dead = self.dead_error
        for stream in self._streams.values():
            stream.put_error(dead)
        self._streams.clear()
