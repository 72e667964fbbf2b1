"""OpenAI's error envelope, and the mapping of every failure to an HTTP status.

Every error body is `{"error": {"message", "type", "param", "code"}}`. Bad input of any kind
(malformed JSON, wrong types, values out of range, unknown fields, prompts over the context
length) is a 400; only a bug in the server is a 500, and a dead engine is a 503.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from mrv2.errors import EngineDeadError

logger = logging.getLogger(__name__)

# OpenAI's `type` per status class.
_ERROR_TYPE_OF_STATUS = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
    503: "service_unavailable_error"}
_PARAM_IN_MESSAGE = re.compile(r"(?:Sampling|Pooling)Params\.(\w+)=")


class OpenAIError(Exception):
    """An error with its HTTP status, rendered in OpenAI's envelope."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or _ERROR_TYPE_OF_STATUS.get(status, "server_error" if status >= 500
                                       else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class BadRequest(OpenAIError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message, 400, param=param, code=code)


def from_value_error(error: ValueError) -> OpenAIError:
    """A ValueError from SamplingParams / PoolingParams, the input processor or the engine
    core: a 400."""
    message = str(error)
    match = _PARAM_IN_MESSAGE.search(message)
    return BadRequest(message, param=match.group(1) if match else None)


def from_validation_error(error: ValidationError | RequestValidationError) -> OpenAIError:
    """Pydantic's (or FastAPI's 422) list of problems -> one 400 naming the first field."""
    problems = error.errors()
    if not problems:
        return BadRequest("invalid request")
    first = problems[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "json_invalid":
        message = f"Invalid JSON in the request body: {first.get('msg', '')}"
        param = None
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' * (len(problems) > 2)})"
    return BadRequest(message, param=param)


def to_openai_error(error: BaseException) -> OpenAIError:
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, (ValidationError, RequestValidationError)):
        return from_validation_error(error)
    if isinstance(error, EngineDeadError):
        return OpenAIError(f"The engine is not running: {error}", 503, code="engine_dead")
    if isinstance(error, (ValueError, TypeError, OverflowError)):
        return from_value_error(ValueError(str(error)))
    logger.error("internal server error", exc_info=error)
    return OpenAIError(f"Internal server error: {type(error).__name__}: {error}", 500,
                       type="internal_server_error")


def allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """The methods of every route of the request's path (Starlette's own 405 names only those
    of one route, and a path served by a GET and a POST route has two)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if route.matches(request.scope)[0] != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    """No response leaves the app outside the envelope, FastAPI's own 404/405/422 included."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        status = error.status_code
        message = str(error.detail) if error.detail else HTTPStatus(status).phrase
        response = OpenAIError(message, status).response()
        response.headers.update(error.headers or {})
        if status == 405:  # RFC 9110: `Allow` lists every method of the path
            response.headers["Allow"] = ", ".join(allowed_methods(app, request))
        return response

    async def _known(_: Request, error: Exception) -> JSONResponse:
        return to_openai_error(error).response()

    # Registered per class: a handler for Exception itself runs in Starlette's outermost
    # middleware, which logs a traceback and re-raises after answering.
    for kind in (ValueError, TypeError, OverflowError, ValidationError, EngineDeadError):
        app.add_exception_handler(kind, _known)
    app.add_exception_handler(Exception, _known)
