"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `.chat(messages)`,
as in vLLM; with `runner="pooling"`, `.embed(prompts)`, `.encode(prompts)` and
`.score(data_1, data_2)` (the decoder's pooled final hidden states, mrv2/pooling_params.py)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from tqdm.auto import tqdm

from mrv2.engine.arg_utils import EngineArgs
from mrv2.engine.input_processor import PromptType
from mrv2.engine.llm_engine import LLMEngine
from mrv2.entrypoints.beam_search import BeamSearchOutput, run_beam_search
from mrv2.entrypoints.chat_utils import render_chat
from mrv2.entrypoints.openai.generation_config import default_sampling_params
from mrv2.entrypoints.scoring import as_inputs, score_pairs, scoring_outputs
from mrv2.models.generation_config import sampling_defaults
from mrv2.outputs import (EmbeddingRequestOutput, Metric, PoolingRequestOutput, RequestOutput,
                          RequestOutputKind, ScoringRequestOutput)
from mrv2.pooling_params import PoolingParams
from mrv2.sampling_params import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 block_size: int = 16, seed: int = 0, kv_cache_memory_gb: float | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False,
                 multiprocess_core: bool = False, generation_config: str = "auto",
                 disable_log_stats: bool = True, **kwargs: Any) -> None:
        """`multiprocess_core=True` runs the engine core (scheduler + executor) in its own
        (spawned) process, so a script must guard its entry point with
        `if __name__ == "__main__":`. The default keeps the core in this process: offline it
        measured faster (bench/test_engine_client.py). `shutdown()`, or interpreter exit,
        stops the core process. `generation_config` ("auto": the model's
        generation_config.json, "vllm": none, or a folder holding one; as the server's
        `--generation-config`), with `override_generation_config`'s fields over it, gives the
        sampling params `generate` uses when given none. `disable_log_stats` is accepted for
        vLLM's scripts: mrv2 logs no periodic stats, and keeps `RequestOutput.metrics` and
        `get_metrics()` either way (they cost next to nothing).

        Other keywords are EngineArgs fields: every engine flag of `mrv2 serve` is one, with
        the same name and meaning (vLLM's `max_logprobs`, `trust_remote_code`,
        `tokenizer_mode`, `load_format`, `swap_space`, `optimization_level`, ...); a value the
        server refuses is refused here with the same ConfigError, and a vLLM option mrv2 does
        not implement (`cpu_offload_gb`, ...) raises UnimplementedOptionError naming it."""
        self.engine_args = EngineArgs(
            model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, seed=seed,
            kv_cache_memory_gb=kv_cache_memory_gb, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, generation_config=generation_config,
            disable_log_stats=disable_log_stats, **kwargs)
        self.llm_engine = LLMEngine(self.engine_args, multiprocess_core=multiprocess_core)
        try:
            # By SamplingParams field name; the server reads its defaults the same way.
            self._sampling_defaults = default_sampling_params(
                self.llm_engine.config.model_config.model, generation_config)
            self._sampling_defaults.update(
                sampling_defaults(self.engine_args.override_generation_config or {}))
        except BaseException:
            self.llm_engine.shutdown()  # a broken folder's file: stop the core process too
            raise
        self._request_counter = itertools.count()
        self.last_stats: dict[str, float] = {}

    def shutdown(self) -> None:
        """Release the engine (and stop the engine-core process, if any). Idempotent."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params `generate` and `chat` use when given none (vLLM's): the
        generation config's temperature, top_p, top_k, min_p, repetition_penalty and
        max_new_tokens (as max_tokens) over SamplingParams' defaults. A new object each call."""
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in input order. Every prompt is validated before any is added. No
        `sampling_params`: `get_default_sampling_params()`."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._run_requests(prompts, sampling_params, use_tqdm, "sampling")

    def _run_requests(self, prompts, params, use_tqdm: bool, what: str) -> list:
        """Every prompt validated, then added with its params (one, or one per prompt), then
        run to completion; outputs in input order."""
        prompts = as_inputs(prompts)
        if isinstance(params, (SamplingParams, PoolingParams)):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} {what} params for "
                                 f"{len(prompts)} prompts; pass one or one per prompt")
        engine = self.llm_engine
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        for request_id, prompt, p in zip(request_ids, prompts, params_list):
            engine.validate_request(request_id, prompt, p)
        for request_id, prompt, p in zip(request_ids, prompts, params_list):
            # vLLM's LLM returns final outputs only, whatever params.output_kind says.
            engine.add_request(request_id, prompt, p, RequestOutputKind.FINAL_ONLY)
        return self._run_engine(request_ids, use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
               pooling_task: str = "embed") -> list[PoolingRequestOutput]:
        """vLLM's, on an engine built with runner="pooling": each prompt's pooled final
        hidden states (`outputs.data`, a float32 tensor of the hidden size; LAST or MEAN and
        normalised per the pooler config, or each PoolingParams), in input order.
        `truncate_prompt_tokens`: keep each prompt's last k tokens (over the params')."""
        if pooling_params is None:
            pooling_params = PoolingParams()
        many = not isinstance(pooling_params, PoolingParams)
        params = [p.clone(task=p.task or pooling_task)
                  for p in (pooling_params if many else [pooling_params])]
        if truncate_prompt_tokens is not None:
            params = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        outputs = self._run_requests(prompts, params if many else params[0], use_tqdm,
                                     "pooling")
        for output in outputs:
            if output.outputs.data is None:
                raise RuntimeError(f"the engine failed request {output.request_id} (NaN in "
                                   f"its hidden states?): no embedding")
        return outputs

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's: `encode` with `outputs.embedding` a list of floats."""
        return [EmbeddingRequestOutput.from_base(output) for output in self.encode(
            prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="embed")]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's for an embedding model: the cosine similarity (`outputs.score`) of each
        pair's embeddings, 1 to 1, 1 to N or N to N (mrv2.entrypoints.scoring)."""
        first, second = as_inputs(data_1), as_inputs(data_2)
        score_pairs(len(first), len(second))  # a bad pairing fails before any work
        outputs = self.encode(first + second, pooling_params, use_tqdm, truncate_prompt_tokens)
        pad = getattr(self.get_tokenizer(), "pad_token_id", None)
        return scoring_outputs(outputs[:len(first)], outputs[len(first):], pad)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's: the best `params.beam_width` sequences of each prompt (a string, or a
        {"prompt": ...} / {"prompt_token_ids": [...]} dict), best first, by the length-penalised
        cumulative logprob (mrv2.entrypoints.beam_search). `concurrency_limit`: at most that
        many prompts searched at once. `lora_request`: mrv2 has no LoRA, so only None."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: mrv2 has no LoRA adapters")
        return run_beam_search(self, prompts, params, use_tqdm, concurrency_limit)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, for an idle engine: level 1 frees the KV cache's memory, level 2
        the weights too; `wake_up()` restores them (level 2 reloads the checkpoint)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's): later prompts are computed from scratch.
        False, doing nothing, while a request holds blocks (never between `generate` calls)."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's `get_metrics()`: Gauge / Counter / Histogram objects (mrv2.outputs) under
        vLLM's `vllm:` names, labelled with the model and engine "0": running and waiting
        requests, KV-cache usage, prefix-cache queries and hits (tokens), preemptions, prompt
        and generation tokens, finished requests by reason, and time-to-first-token,
        end-to-end latency, prompt and generation length histograms. Counts are of engine
        requests (a request with n > 1 counts n) since this LLM was built."""
        return self.llm_engine.get_metrics()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: run `method` on every worker and return one result per worker (rank
        order). A name calls that method of the worker (mrv2.worker.Worker); a callable runs as
        `method(worker, *args, **kwargs)` (with tensor_parallel_size > 1 it must pickle: a
        module-level function). Not available with `multiprocess_core=True`."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of conversations, rendered with the tokenizer's chat template (or
        `chat_template`). Returns one RequestOutput per conversation, as `generate` does (and
        with its default sampling params). `tools` (OpenAI's function tools) go to the
        template, as vLLM's; parse the calls from the text, or constrain it with
        SamplingParams.structured_outputs."""
        conversations = _as_conversations(messages)
        template_kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            template_kwargs.setdefault("tools", tools)
        prompts = [self._render_chat(conversation, chat_template, add_generation_prompt,
                                     continue_final_message, template_kwargs)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _render_chat(self, conversation, chat_template, add_generation_prompt,
                     continue_final_message, template_kwargs) -> dict[str, Any]:
        return render_chat(self.get_tokenizer(), conversation, chat_template,
                           add_generation_prompt, continue_final_message, template_kwargs)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        num_prompt_tokens = num_output_tokens = 0
        start = time.perf_counter()
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    finished[output.request_id] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):  # a pooling output has no tokens
                        num_output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {num_prompt_tokens / elapsed:.1f} toks/s, "
                                        f"output: {num_output_tokens / elapsed:.1f} toks/s")
        except BaseException:
            # Leave the engine usable: drop what this call added and did not finish.
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        elapsed = time.perf_counter() - start
        self.last_stats = {"elapsed_s": elapsed, "num_requests": len(request_ids),
                           "num_prompt_tokens": num_prompt_tokens,
                           "num_output_tokens": num_output_tokens}
        # Finished and aborted (stop string) requests still hold runner slots until the core
        # tells the runner, and with async scheduling a step may still be in flight: drain
        # both now rather than at the next call.
        engine.drain()
        return [finished[r] for r in request_ids]


def _as_conversations(messages) -> list[list[Mapping[str, Any]]]:
    """One conversation (messages) or a list of conversations -> a list of conversations."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a "
                         "list of such lists")
    conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
    for conversation in conversations:
        if (isinstance(conversation, (str, Mapping)) or not isinstance(conversation, Sequence)
                or not conversation):
            raise ValueError("each conversation must be a non-empty list of messages")
        for message in conversation:
            if not isinstance(message, Mapping) or "role" not in message:
                raise ValueError(f"a chat message must be a dict with a 'role', got {message!r}")
    return conversations
