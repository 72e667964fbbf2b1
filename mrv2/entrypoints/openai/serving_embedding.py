"""The routes of an embedding server (`mrv2 serve --runner pooling`): OpenAI's
`POST /v1/embeddings`, and vLLM's `POST /score` (`/v1/score`) and `POST /rerank` (`/v1/rerank`,
`/v2/rerank`) for embedding models, whose scores are cosine similarities
(mrv2/entrypoints/scoring.py).

Every input is one engine request (a pooling one, mrv2/pooling_params.py); all of them are
validated before any runs, and a client that goes away aborts them. An engine runs one
runner: on a generate server these routes answer vLLM's 400 ("The model does not support
Embeddings API"), and on a pooling server the generation routes do (`check_runner`).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError
from mrv2.entrypoints.openai.protocol_pooling import (EmbeddingRequest, EmbeddingResponse,
                                                      RerankRequest, RerankResponse,
                                                      ScoreRequest, ScoreResponse)
from mrv2.entrypoints.openai.answer_schemas import json_response, request_body
from mrv2.entrypoints.openai.server_routes import log_request
from mrv2.entrypoints.openai.serving_engine import (OpenAIServing, merge_streams, now,
                                                    random_id, run_until_disconnected)
from mrv2.entrypoints.scoring import as_inputs, score_pairs, scoring_outputs
from mrv2.outputs import PoolingRequestOutput, ScoringRequestOutput
from mrv2.pooling_params import PoolingParams

POOLING_ERRORS = (400, 401, 404, 500, 503)
# The request bodies of these routes, for /openapi.json (install_openapi's `requests`).
POOLING_REQUESTS = (EmbeddingRequest, ScoreRequest, RerankRequest)


def check_runner(engine, runner: str, api: str) -> None:
    """vLLM's 400 for a route the engine's runner does not serve, with the flag that would."""
    if engine.config.model_config.runner != runner:
        raise BadRequest(f"The model does not support {api} API: this server was started "
                         f"with --runner {engine.config.model_config.runner}; start it with "
                         f"--runner {runner} to use it")


class OpenAIServingEmbedding(OpenAIServing):
    def _prompt(self, item: str | list[int], params: PoolingParams,
                add_special_tokens: bool = True) -> dict[str, Any]:
        """One input as an engine prompt: tokenized, truncated, within the context."""
        text = None
        if isinstance(item, str):
            self.check_tokenizer("a text input")
            text = item
            ids = list(self.tokenizer(item, add_special_tokens=add_special_tokens).input_ids)
        else:
            ids = list(item)
        kept = params.truncate(ids, self.max_model_len)
        if not kept:
            raise BadRequest("the input is empty", param="input")
        if len(kept) >= self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(kept)} tokens in the input for embedding generation. "
                f"Please reduce the length of the input (mrv2 embeds prompts of up to "
                f"{self.max_model_len - 1} tokens).", param="input",
                code="context_length_exceeded")
        return {"prompt_token_ids": kept, "prompt": text if len(kept) == len(ids) else None}

    async def _encode(self, prompt: dict[str, Any], params: PoolingParams,
                      request_id: str) -> AsyncIterator[PoolingRequestOutput]:
        """The engine's output for one prompt, with metrics; closing early aborts it."""
        timer = self.metrics.request_timer(len(prompt["prompt_token_ids"]))
        done = False
        try:
            async with aclosing(self.engine.encode(prompt, params, request_id)) as outputs:
                async for output in outputs:
                    if output.outputs.data is None:  # the engine failed this request alone
                        raise OpenAIError("Internal server error: the engine could not "
                                          "complete this request", 500)
                    timer.on_completion_finished("stop")
                    done = True
                    yield output
        finally:
            timer.on_request_finished(aborted=not done)

    async def _embed_all(self, prompts: list[dict[str, Any]], params: PoolingParams,
                         prefix: str, raw_request: Request) -> list[PoolingRequestOutput]:
        """Every prompt's embedding, in order; all validated before any runs."""
        params = self.engine.input_processor.resolve_pooling(params)  # ValueError: a 400
        for prompt in prompts:
            self.engine.input_processor.process("validate", prompt, params)
        request_id = random_id(prefix)
        streams = [self._encode(prompt, params, f"{request_id}-{i}")
                   for i, prompt in enumerate(prompts)]

        async def collect() -> list[PoolingRequestOutput]:
            outputs: list[Any] = [None] * len(prompts)
            async for i, output in merge_streams(streams):
                outputs[i] = output
            return outputs

        return await run_until_disconnected(raw_request, collect())

    async def embed(self, request: EmbeddingRequest, raw_request: Request) -> dict[str, Any]:
        check_runner(self.engine, "pooling", "Embeddings")
        self.check_model(request.model)
        params = request.pooling_params()
        items = request.input
        if isinstance(items, str) or (items and isinstance(items[0], int)):
            items = [items]
        if not items:
            raise BadRequest("input must not be empty", param="input")
        prompts = [self._prompt(item, params, request.add_special_tokens) for item in items]
        outputs = await self._embed_all(prompts, params, "embd", raw_request)
        data = [{"index": i, "object": "embedding",
                 "embedding": _encode_vector(output.outputs.data, request.encoding_format)}
                for i, output in enumerate(outputs)]
        tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return {"id": random_id("embd"), "object": "list", "created": now(),
                "model": self.config.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(self, first: list[str], second: list[str], truncate: int | None,
                      raw_request: Request) -> list[ScoringRequestOutput]:
        try:
            score_pairs(len(first), len(second))
        except ValueError as error:
            raise BadRequest(str(error)) from None
        params = PoolingParams(truncate_prompt_tokens=truncate, task="embed")
        prompts = [self._prompt(item, params) for item in first + second]
        outputs = await self._embed_all(prompts, params, "score", raw_request)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return scoring_outputs(outputs[:len(first)], outputs[len(first):], pad)

    async def score(self, request: ScoreRequest, raw_request: Request) -> dict[str, Any]:
        check_runner(self.engine, "pooling", "Score")
        self.check_model(request.model)
        first, second = (as_inputs(side) for side in request.sides())
        scores = await self._scores(first, second, request.truncate_prompt_tokens, raw_request)
        tokens = sum(len(score.prompt_token_ids) for score in scores)
        return {"id": random_id("score"), "object": "list", "created": now(),
                "model": self.config.model_name,
                "data": [{"index": i, "object": "score", "score": score.outputs.score}
                         for i, score in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(self, request: RerankRequest, raw_request: Request) -> dict[str, Any]:
        check_runner(self.engine, "pooling", "Rerank")
        self.check_model(request.model)
        documents = request.documents
        scores = await self._scores([request.query], documents, request.truncate_prompt_tokens,
                                    raw_request)
        results = sorted(({"index": i, "document": {"text": documents[i]},
                           "relevance_score": score.outputs.score}
                          for i, score in enumerate(scores)),
                         key=lambda result: -result["relevance_score"])
        if request.top_n:
            results = results[:request.top_n]
        return {"id": random_id("rerank"), "model": self.config.model_name,
                "usage": {"total_tokens": sum(len(s.prompt_token_ids) for s in scores)},
                "results": results}


def _encode_vector(vector, encoding_format: str) -> list[float] | str:
    """OpenAI's: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def install_pooling_routes(app: FastAPI, serving: OpenAIServingEmbedding,
                           parse_body: Callable) -> None:
    """The embedding, score and rerank routes (on every server: a generate one refuses them,
    and leaves them out of its /openapi.json, which describes what the server serves; their
    bodies are POOLING_REQUESTS). `parse_body`: the app's body parser."""
    config = serving.config
    served = serving.engine.config.model_config.runner == "pooling"

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest),
              responses=json_response(EmbeddingResponse, *POOLING_ERRORS),
              include_in_schema=served)
    async def create_embedding(raw_request: Request) -> Response:
        request = await parse_body(raw_request, EmbeddingRequest)
        log_request(config, "/v1/embeddings", request)
        return JSONResponse(await serving.embed(request, raw_request))

    async def create_score(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ScoreRequest)
        log_request(config, "/score", request)
        return JSONResponse(await serving.score(request, raw_request))

    async def do_rerank(raw_request: Request) -> Response:
        request = await parse_body(raw_request, RerankRequest)
        log_request(config, "/rerank", request)
        return JSONResponse(await serving.rerank(request, raw_request))

    for paths, endpoint, body, answer in ((("/score", "/v1/score"), create_score, ScoreRequest,
                                           ScoreResponse),
                                          (("/rerank", "/v1/rerank", "/v2/rerank"), do_rerank,
                                           RerankRequest, RerankResponse)):
        for path in paths:
            app.add_api_route(path, endpoint, methods=["POST"], openapi_extra=request_body(body),
                              responses=json_response(answer, *POOLING_ERRORS),
                              include_in_schema=served)
