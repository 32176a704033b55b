"""``HotPathApp``: the router's FastAPI app, with the generation POSTs dispatched directly.

Starlette hands every request through a stack of ASGI layers before the endpoint runs
(``ServerErrorMiddleware``, ``ExceptionMiddleware``, FastAPI's ``AsyncExitStackMiddleware``, the
router's path matching over every route, the route's ``request_response`` wrapper and its
exception wrapper), each an ``await`` and most a wrapped ``send``: about a tenth of the router's
own CPU per request measured under the bench (docs/architecture.md, "Hot path"). For an exact
``POST`` to a :class:`~services.router.frontend.direct_route.DirectRoute` path this app calls the
route's handler itself and answers its exceptions from the app's own exception handler table (the
same lookup as Starlette's: the exception's MRO against ``exception_handlers``), so responses, error
envelopes and error counting are the same as through the stack. Everything else (other paths
and methods, a trailing slash, ``/metrics``, ``/health``, the lifespan) goes through FastAPI
unchanged, and the OpenAPI schema is FastAPI's.

An app with user middleware, or a ``root_path``, takes no shortcut (the middleware would be
skipped, the path would need rewriting).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from services.router.frontend.direct_route import DirectRoute

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class HotPathApp(FastAPI):
    """A FastAPI app whose :class:`DirectRoute` POSTs skip the middleware stack; see the
    module docstring."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._direct: dict[str, Handler] | None = None

    @property
    def direct_paths(self) -> frozenset[str]:
        """The paths whose POSTs skip the stack."""
        if self._direct is None:
            self._direct = self._direct_routes()
        return frozenset(self._direct)

    def _direct_routes(self) -> dict[str, Handler]:
        """Path -> handler of every parameterless POST DirectRoute (built on first use, once
        every router is included)."""
        if self.user_middleware or self.root_path:
            return {}
        return {
            route.path: route.handler
            for route in self.router.routes
            if isinstance(route, DirectRoute)
            and route.methods == {"POST"}
            and not route.param_convertors
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            direct = self._direct
            if direct is None:
                direct = self._direct = self._direct_routes()
            handler = direct.get(scope["path"])
            if handler is not None and not scope.get("root_path"):
                scope["app"] = self
                request = Request(scope, receive, send)
                try:
                    response = await handler(request)
                except Exception as exc:
                    response = await self._handled(request, exc)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _handled(self, request: Request, exc: Exception) -> Response:
        """``exc`` answered by the app's handler for its class (the app installs one for
        ``Exception``, so every exception has one; without it, re-raised as Starlette
        would)."""
        for cls in type(exc).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                answer = handler(request, exc)  # the router's handlers are all async
                response: Response = await answer if inspect.isawaitable(answer) else answer
                return response
        raise exc
