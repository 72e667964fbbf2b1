"""The FastAPI app of `mrv2 serve`, and running it with uvicorn.

The engine core runs in its own process (AsyncLLM); this process parses requests, tokenizes,
detokenizes and streams, on one event loop. With `--api-key`, every `/v1` path needs
`Authorization: Bearer KEY` (the other paths - health, metrics, tokenize, version - do not, as
in vLLM).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from mrv2.engine.async_llm import AsyncLLM
from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import OpenAIError, from_validation_error, \
    install_error_handlers
from mrv2.entrypoints.openai.generation_config import default_sampling_params
from mrv2.models.generation_config import sampling_defaults
from mrv2.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from mrv2.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                              DetokenizeRequest, TokenizeRequest)
from mrv2.entrypoints.openai.answer_schemas import (
    GENERATION_CHUNKS, GENERATION_REQUESTS, ChatCompletionResponse, ChatCompletionStreamResponse,
    CompletionResponse, CompletionStreamResponse, DetokenizeResponse, ModelList, TokenizeResponse,
    VersionResponse, empty_response, generation_responses, install_openapi, json_response,
    request_body, text_response)
from mrv2.entrypoints.openai.responses_output import ResponseStreamEvent
from mrv2.entrypoints.openai.responses_protocol import ResponsesRequest, ResponsesResponse
from mrv2.entrypoints.openai.serving_chat import OpenAIServingChat
from mrv2.entrypoints.openai.serving_responses import OpenAIServingResponses
from mrv2.entrypoints.openai.serving_completion import OpenAIServingCompletion
from mrv2.entrypoints.openai.serving_embedding import (POOLING_REQUESTS, OpenAIServingEmbedding,
                                                       check_runner, install_pooling_routes)
from mrv2.entrypoints.openai.server_routes import (check_max_logprobs, configure_logging,
                                                   health_response, install_server_routes,
                                                   log_request, stats_lifespan,
                                                   uvicorn_settings)
from mrv2.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
RESPONSE_EVENTS = ("Server-sent events, each an `event:` line naming its type and a `data:` "
                   "line holding it (a ResponseStreamEvent); the last is response.completed, "
                   "or on a failure an error event")
STATS_TIMEOUT_S = 5.0
GRACEFUL_SHUTDOWN_S = 5


class APIKeyMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would sit between a stream and its disconnect)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") \
                and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = OpenAIError("Incorrect or missing API key. Send it as "
                                    "'Authorization: Bearer KEY'.", 401, code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def parse_body(raw_request: Request, model: type[M]) -> M:
    try:
        body = await raw_request.body()
    except ClientDisconnect:
        # The client left before its body arrived: nothing was accepted, so there is nothing
        # to abort. Raised as an OpenAIError (the 499 of a dropped request) because any other
        # exception reaches Starlette's ServerErrorMiddleware, which logs it as a server error.
        raise OpenAIError("Client disconnected", 499) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        raise from_validation_error(error) from None


def respond(result: dict[str, Any] | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    from mrv2 import __version__

    metrics = ServerMetrics(config.model_name)
    docs = {} if not config.disable_fastapi_docs else \
        {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mrv2 OpenAI-compatible server", version=__version__,
                  root_path=config.root_path or "",
                  lifespan=lambda _: stats_lifespan(engine, config, metrics.registry), **docs)
    install_error_handlers(app)
    # A server's /openapi.json describes the routes its runner serves; the others answer
    # vLLM's 400 naming the runner that would (check_runner).
    model_config = engine.config.model_config
    generates = model_config.runner == "generate"
    bounds = dict(vocab_size=model_config.vocab_size, max_model_len=model_config.max_model_len,
                  auto_tool_choice=config.tool_call_parser is not None)
    if generates:
        install_openapi(app, requests=[*GENERATION_REQUESTS, ResponsesRequest],
                        chunks=[*GENERATION_CHUNKS, ResponseStreamEvent], **bounds)
    else:
        install_openapi(app, requests=POOLING_REQUESTS, **bounds)
    install_server_routes(app, engine, config)  # CORS, /ping, /load, dev-mode routes
    if config.api_key:  # outside CORS, as in vLLM (preflight OPTIONS passes it)
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    defaults = default_sampling_params(config.model, config.generation_config)
    defaults.update(sampling_defaults(config.override_generation_config))
    chat = OpenAIServingChat(engine, config, metrics, defaults)
    completion = OpenAIServingCompletion(engine, config, metrics, defaults)
    tokenization = OpenAIServingTokenization(chat)
    responses = OpenAIServingResponses(chat)
    app.state.engine, app.state.config, app.state.metrics = engine, config, metrics

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=generation_responses(CompletionResponse, CompletionStreamResponse),
              include_in_schema=generates)
    async def create_completion(raw_request: Request) -> Response:
        check_runner(engine, "generate", "Completions")
        request = await parse_body(raw_request, CompletionRequest)
        check_max_logprobs(request, config.max_logprobs)
        log_request(config, "/v1/completions", request)
        return respond(await completion.create(request, raw_request))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses=generation_responses(ChatCompletionResponse,
                                             ChatCompletionStreamResponse),
              include_in_schema=generates)
    async def create_chat_completion(raw_request: Request) -> Response:
        check_runner(engine, "generate", "Chat Completions")
        request = await parse_body(raw_request, ChatCompletionRequest)
        check_max_logprobs(request, config.max_logprobs)
        log_request(config, "/v1/chat/completions", request)
        return respond(await chat.create(request, raw_request))

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest),
              responses=generation_responses(ResponsesResponse, ResponseStreamEvent,
                                             RESPONSE_EVENTS), include_in_schema=generates)
    async def create_response(raw_request: Request) -> Response:
        check_runner(engine, "generate", "Responses")
        request = await parse_body(raw_request, ResponsesRequest)
        check_max_logprobs(request, config.max_logprobs)
        log_request(config, "/v1/responses", request)
        return respond(await responses.create(request, raw_request))

    @app.get("/v1/responses/{response_id}",
             responses=json_response(ResponsesResponse, 401, 404, 500),
             include_in_schema=generates)
    async def retrieve_response(response_id: str) -> Response:
        return JSONResponse(responses.retrieve(response_id))

    # /v1/embeddings, /score, /rerank: served with --runner pooling, refused otherwise.
    install_pooling_routes(app, OpenAIServingEmbedding(engine, config, metrics, {}), parse_body)

    @app.get("/v1/models", responses=json_response(ModelList, 401, 500))
    async def models() -> Response:
        return JSONResponse(tokenization.models())

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
              responses=json_response(TokenizeResponse, 400, 404, 500))
    async def tokenize(raw_request: Request) -> Response:
        return JSONResponse(tokenization.tokenize(await parse_body(raw_request,
                                                                   TokenizeRequest)))

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses=json_response(DetokenizeResponse, 400, 404, 500))
    async def detokenize(raw_request: Request) -> Response:
        return JSONResponse(tokenization.detokenize(await parse_body(raw_request,
                                                                     DetokenizeRequest)))

    @app.get("/health", response_class=Response, responses=empty_response(503))
    async def health() -> Response:
        return health_response(engine)

    @app.get("/metrics", response_class=Response, responses=text_response(
        CONTENT_TYPE, "Prometheus metrics (text exposition format)"))
    async def metrics_endpoint() -> Response:
        try:
            stats = await asyncio.wait_for(engine.get_engine_stats(), STATS_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - a dead engine still has API metrics
            logger.debug("no engine stats for /metrics: %r", error)
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/version", responses=json_response(VersionResponse))
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    return app


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


class PortInUseError(ValueError):
    """The server's address is taken: said before any weight is loaded."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads (as vLLM does), so a busy port
    fails in a moment rather than after the model has loaded."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_server(args) -> int:
    """`mrv2 serve`: bind the port, build the engine, then serve until SIGINT / SIGTERM."""
    import uvicorn

    from mrv2.entrypoints.openai.cli_args import (engine_args_from, resolve_model,
                                                  server_config_from)
    from executor.heap import freeze_startup_objects

    model = resolve_model(args)
    config = server_config_from(args, model)
    configure_logging()
    default_sampling_params(model, config.generation_config)  # a bad value fails before loading
    sock = bind_socket(config.host, config.port)
    try:
        engine = AsyncLLM.from_engine_args(engine_args_from(args, model))
    except BaseException:
        sock.close()
        raise
    # uvicorn re-raises the SIGTERM / SIGINT it caught once it has shut down; with the default
    # SIGTERM action that would kill this process before `finally` stops the engine core and
    # removes its socket directory. Turned into SystemExit, the unwinding runs.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        app = build_app(engine, config)
        freeze_startup_objects()  # this process serves one engine for its life (executor/heap.py)
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **uvicorn_settings(config)))
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0
