"""Errors of the router, each answered with the OpenAI error envelope by one handler.

::

    RouterError                        every request-scoped router error (status, type, code)
    ├── InvalidRequestError        400  a bad or unsupported parameter (``param`` names it)
    ├── AuthenticationError        401  missing or wrong API key
    ├── ModelNotFound              404  no engine in the control plane serves that model
    ├── NoEngineAvailable          503  engines exist but no usable READY one (or pair)
    └── EngineRequestFailed        502  an engine failed the request (``code`` says how);
                                        503 when it is overloaded or draining

``code`` doubles as the ``outcome`` label of ``pdserve_router_requests_total``. Engine errors
(:mod:`services.engines.errors`, ``services.serving.errors.EngineUnreachable``) are translated
to these at one place, :func:`services.router.execution.engine_error`.
"""

from __future__ import annotations


class RouterError(Exception):
    """A request-scoped error with its HTTP status and OpenAI ``type`` / ``code``."""

    status_code = 500
    error_type = "api_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def envelope(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(RouterError):
    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(RouterError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(RouterError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class NoEngineAvailable(RouterError):
    status_code = 503
    error_type = "service_unavailable"
    code = "no_engine_available"


class EngineRequestFailed(RouterError):
    """An engine failed the request; ``retryable`` when another engine might succeed."""

    status_code = 502
    error_type = "api_error"
    code = "engine_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status_code: int | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message, code=code)
        if status_code is not None:
            self.status_code = status_code
        self.retryable = retryable
