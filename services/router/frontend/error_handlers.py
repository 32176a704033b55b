"""The router's one exception-handler table: every error as the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}`` (FastAPI's validation errors and
Starlette's 404/405 included), request errors counted per endpoint and code."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.engines.errors import TokenizerError
from services.router.errors import InvalidRequestError, RouterError
from services.router.frontend.responses import json_response
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI envelope; request errors counted per endpoint and code."""

    def count(request: Request, code: str) -> None:
        path = request.url.path
        if path.startswith("/v1/"):
            runtime: RouterRuntime | None = getattr(request.app.state, "runtime", None)
            if runtime is not None:
                runtime.metrics.requests.labels(endpoint=path, outcome=code).inc()

    async def on_router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        count(request, exc.code)
        headers = {"www-authenticate": "Bearer"} if exc.status_code == 401 else None
        return json_response(exc.status_code, exc.envelope(), headers)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc)
        count(request, error.code)
        return json_response(error.status_code, error.envelope())

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        error = RouterError(str(exc.detail), code=codes.get(exc.status_code, "http_error"))
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "api_error"
        count(request, error.code)
        return json_response(exc.status_code, error.envelope(), dict(exc.headers or {}))

    async def on_tokenizer_error(request: Request, exc: Exception) -> Response:
        error = InvalidRequestError(str(exc), param="prompt")
        count(request, error.code)
        return json_response(400, error.envelope())

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path, exc_info=exc)
        count(request, "internal_error")
        return json_response(500, RouterError("internal error").envelope())

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(TokenizerError, on_tokenizer_error)
    app.add_exception_handler(Exception, on_unexpected)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """FastAPI's 422 as OpenAI's 400: the first problem, its field as ``param``."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return InvalidRequestError(
            f"unsupported parameter {param!r}", param=param, code="unsupported_parameter"
        )
    if kind in ("json_invalid", "model_attributes_type", "model_type", "dict_type"):
        return InvalidRequestError(
            f"the body must be a JSON object: {first.get('msg', '')}", code="invalid_json"
        )
    if kind == "missing":
        return InvalidRequestError(f"missing required parameter {param!r}", param=param)
    return InvalidRequestError(
        f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param
    )
