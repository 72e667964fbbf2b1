"""vLLM's server surface beyond the OpenAI routes: `/ping`, `/load`, the dev-mode routes, CORS,
request and stats logging, the request-side `--max-logprobs` check and uvicorn's settings.

As in vLLM, `/server_info`, `/reset_prefix_cache`, `/sleep`, `/wake_up` and `/is_sleeping`
exist only when the environment variable VLLM_SERVER_DEV_MODE is 1 (they are not meant for
production).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import platform
import sys
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from mrv2.engine.async_llm import AsyncLLM
from mrv2.entrypoints.openai.cli_args import ServerConfig
from mrv2.entrypoints.openai.errors import BadRequest, OpenAIError
from mrv2.entrypoints.openai.answer_schemas import (IsSleepingResponse, LoadResponse,
                                                        ResetPrefixCacheResponse,
                                                        ServerInfoResponse, empty_response,
                                                        json_response)

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# The routes /load counts (vLLM's: those that run the model).
LOADED_PATHS = ("/v1/completions", "/v1/chat/completions")
STATS_INTERVAL_S = 10.0  # vLLM's VLLM_LOG_STATS_INTERVAL default


def dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def health_response(engine: AsyncLLM) -> Response:
    """/health and /ping: 200, or 503 once the engine core is dead."""
    if engine.errored:
        return OpenAIError(str(engine.dead_error), 503, code="engine_dead").response()
    return empty_success()


def empty_success() -> Response:
    """A 200 with an empty body, typed as the schema declares it (empty_response: text/plain;
    a response without a Content-Type fails schema conformance checks)."""
    return Response(status_code=200, media_type="text/plain")


class LoadTracker:
    """Pure ASGI: counts requests in flight on LOADED_PATHS (a stream counts until its last
    byte is sent) for /load."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOADED_PATHS:
            await self.app(scope, receive, send)
            return
        self.state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load_metrics -= 1


def install_server_routes(app: FastAPI, engine: AsyncLLM, config: ServerConfig) -> None:
    """CORS, /ping, /load (+ its counter), and the dev-mode routes when enabled."""
    from fastapi.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                       allow_credentials=config.allow_credentials,
                       allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers)
    app.state.server_load_metrics = 0
    if config.enable_server_load_tracking:
        app.add_middleware(LoadTracker, state=app.state)

    @app.get("/ping", response_class=Response, responses=empty_response(503))
    @app.post("/ping", response_class=Response, responses=empty_response(503))
    async def ping() -> Response:
        return health_response(engine)

    @app.get("/load", responses=json_response(LoadResponse))
    async def load() -> Response:
        return JSONResponse({"server_load": app.state.server_load_metrics})

    if dev_mode():
        logger.warning("SECURITY WARNING: development endpoints are enabled (%s=1): not for "
                       "production", DEV_MODE_ENV)
        install_dev_routes(app, engine)


def install_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.get("/server_info", responses=json_response(ServerInfoResponse, 400))
    async def server_info(config_format: str = "text") -> Response:
        if config_format not in ("text", "json"):
            raise BadRequest(f"config_format must be 'text' or 'json', got {config_format!r}",
                             param="config_format")
        engine_config = (str(engine.config) if config_format == "text"
                         else json.loads(json.dumps(engine.config, default=_jsonable)))
        return JSONResponse({"vllm_config": engine_config, "versions": versions()})

    @app.post("/reset_prefix_cache", responses=json_response(ResetPrefixCacheResponse, 500))
    async def reset_prefix_cache() -> Response:
        reset = await engine.reset_prefix_cache()
        if not reset:
            logger.warning("prefix cache not reset: requests still hold cached blocks")
        return JSONResponse({"reset": reset})

    @app.post("/sleep", response_class=Response, responses=empty_response(400))
    async def sleep(level: int = 1) -> Response:
        try:
            await engine.sleep(level)
        except (ValueError, RuntimeError) as error:  # a bad level, or requests running
            raise BadRequest(str(error), param="level") from None
        return empty_success()

    @app.post("/wake_up", response_class=Response, responses=empty_response(400))
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        try:
            await engine.wake_up(tags)
        except ValueError as error:
            raise BadRequest(str(error), param="tags") from None
        return empty_success()

    @app.get("/is_sleeping", responses=json_response(IsSleepingResponse))
    async def is_sleeping() -> Response:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "to_dict"):  # transformers' PretrainedConfig
        return value.to_dict()
    return str(value)


def versions() -> dict[str, str]:
    import torch
    import transformers

    from mrv2 import __version__

    return {"mrv2": __version__, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def check_max_logprobs(request: Any, max_logprobs: int | None) -> None:
    """vLLM's --max-logprobs on a request (AsyncLLM does not check it): a 400 naming the
    field."""
    if max_logprobs is None:
        return
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(request, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > max_logprobs:
            raise BadRequest(f"{name}={value} is greater than max allowed: {max_logprobs} "
                             f"(--max-logprobs)", param=name)


def log_request(config: ServerConfig, path: str, request: Any) -> None:
    """--enable-log-requests: the request's fields, cut to --max-log-len characters."""
    if not config.enable_log_requests:
        return
    text = json.dumps(request.model_dump(exclude_unset=True), default=str)
    if config.max_log_len is not None:
        text = text[:config.max_log_len]
    logger.info("Received request %s: %s", path, text)


@contextlib.asynccontextmanager
async def stats_lifespan(engine: AsyncLLM, config: ServerConfig, registry):
    """The app's lifespan: vLLM's periodic stats line, unless --disable-log-stats."""
    task = None
    if not config.disable_log_stats:
        task = asyncio.get_running_loop().create_task(
            _log_stats(engine, registry, config.model_name), name="mrv2-log-stats")
    try:
        yield
    finally:
        if task is not None:
            task.cancel()


async def _log_stats(engine: AsyncLLM, registry, model_name: str) -> None:
    labels = {"model_name": model_name}
    last = (0.0, 0.0)
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        try:
            stats = await engine.get_stats()
        except Exception as error:  # noqa: BLE001 - a dead engine: /health says so
            logger.debug("no engine stats to log: %r", error)
            continue
        now = tuple(registry.get_sample_value(name, labels) or 0.0 for name in
                    ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"))
        if now == last and not stats.num_unfinished:
            continue  # idle: nothing to say (as vLLM)
        hits = stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1)
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%", (now[0] - last[0]) / STATS_INTERVAL_S,
                    (now[1] - last[1]) / STATS_INTERVAL_S, stats.num_running,
                    stats.num_waiting, 100 * stats.kv_cache_usage, 100 * hits)
        last = now


def uvicorn_settings(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config keywords of the TLS and access-log flags."""
    return {"ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile,
            "ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": config.ssl_cert_reqs,
            "access_log": not config.disable_uvicorn_access_log}


def configure_logging() -> None:
    """mrv2's INFO lines (requests, stats) on stderr, as vLLM prints its own; once."""
    root = logging.getLogger("mrv2")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
