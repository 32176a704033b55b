"""``DirectRoute``: the generation endpoints without FastAPI's per-request machinery.

FastAPI answers a request by solving the endpoint's dependency graph (query parameters, the
API key dependency, the runtime dependency), parsing the body with ``json.loads`` and then
validating the resulting dicts with pydantic: about a tenth of the router's own CPU per request,
next to two gRPC calls. A :class:`DirectRoute` is declared like any FastAPI route (so the
OpenAPI schema, which schemathesis fuzzes, is FastAPI's, from the endpoint's signature) but
runs a fixed handler: the API key check, the body validated straight from its bytes by
pydantic-core (``model_validate_json``), then ``endpoint(body, runtime, request)``.

Errors take the same paths as before: the key check raises the router's
``AuthenticationError``, a body that does not validate raises FastAPI's
``RequestValidationError`` with pydantic's errors (loc prefixed with ``"body"`` as FastAPI does),
and both reach the app's one exception handler table (``error_handlers.install_error_handlers``).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from services.router.errors import RequestTooLarge
from services.router.frontend.tokenizing import INLINE_BODY_BYTES
from services.router.runtime import RouterRuntime

KeyCheck = Callable[[Request, RouterRuntime], Awaitable[None]]


class DirectRoute(APIRoute):
    """A route whose endpoint is ``async def endpoint(body: Model, runtime, http: Request)``;
    see the module docstring. The key check is the router's (:attr:`key_check`, set by the
    API module before routes are declared)."""

    key_check: typing.ClassVar[KeyCheck | None] = None
    handler: Callable[[Request], Coroutine[Any, Any, Response]]
    """The fixed handler (also called directly by ``hot_path.HotPathApp``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint
        model = _body_model(endpoint)
        check = type(self).key_check
        if check is None:
            raise RuntimeError("DirectRoute.key_check is not set")

        async def handler(request: Request) -> Response:
            runtime: RouterRuntime = request.app.state.runtime
            await check(request, runtime)
            raw = await _body_of(request, runtime.settings.max_request_body_bytes)
            if not _json_content_type(request.headers.get("content-type")):
                # As FastAPI: a body that is not declared JSON is not parsed as JSON.
                raise RequestValidationError(
                    [
                        {
                            "type": "model_attributes_type",
                            "loc": ("body",),
                            "msg": "Input should be a valid dictionary or object to extract "
                            "fields from",
                            "input": None,
                        }
                    ]
                )
            if not raw:
                raise RequestValidationError(
                    [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
                )
            try:
                if len(raw) <= INLINE_BODY_BYTES:
                    body = model.model_validate_json(raw)
                else:  # tens of milliseconds for megabytes: not on the event loop
                    body = await runtime.prompts.offload(
                        functools.partial(model.model_validate_json, raw)
                    )
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                for error in errors:
                    error["loc"] = ("body", *error["loc"])
                raise RequestValidationError(errors) from None
            response: Response = await endpoint(body, runtime, request)
            return response

        self.handler = handler
        return handler


async def _body_of(request: Request, limit: int) -> bytes:
    """The request's body from its ASGI messages, as ``Request.body`` reads it (which goes
    through an async generator, registered with the loop and closed, per request); a client
    that hangs up first raises Starlette's ``ClientDisconnect`` as there. The body is not kept
    on ``request``: nothing on this path reads it twice. A body over ``limit`` bytes raises
    :class:`RequestTooLarge`: before anything is read when ``Content-Length`` says so, else as
    soon as the bytes read pass it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge.of_body(int(declared), limit)
    receive = request.receive
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge.of_body(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _json_content_type(value: str | None) -> bool:
    """FastAPI's rule: no content type, ``application/json`` or ``application/*+json``."""
    if not value:
        return True
    main, _, sub = value.split(";", 1)[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _body_model(endpoint: Callable[..., Any]) -> type[BaseModel]:
    """The pydantic model of the endpoint's first parameter."""
    hints = typing.get_type_hints(endpoint, include_extras=True)
    first = next(iter(name for name in hints if name != "return"))
    model = hints[first]
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{endpoint.__name__}: the first parameter must be a pydantic model")
    return model
