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
to these at one place, :func:`engine_error`.
"""

from __future__ import annotations

import logging

from services.engines import errors as engine_errors
from services.serving.errors import EngineUnreachable, ProtocolMismatch

logger = logging.getLogger(__name__)


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


def engine_error(exc: Exception, *, stage: str) -> RouterError:
    """Translate an engine call's exception into the router's error (the one table).

    ``retryable`` marks the failures another engine may not have (overloaded, draining,
    unreachable, failed, timed out); bad input is the client's (400) and never retried.
    """
    if isinstance(exc, RouterError):
        return exc
    message = f"{stage} failed: {exc}" if str(exc) else f"{stage} failed: {type(exc).__name__}"
    if isinstance(exc, engine_errors.InvalidRequest):
        return InvalidRequestError(str(exc))
    if isinstance(exc, engine_errors.EngineOverloaded):
        return EngineRequestFailed(
            message, code="engine_overloaded", status_code=503, retryable=True
        )
    if isinstance(exc, engine_errors.EngineDraining):
        return EngineRequestFailed(message, code="engine_draining", status_code=503, retryable=True)
    if isinstance(exc, engine_errors.EngineFailed):
        return EngineRequestFailed(message, code="engine_failed", retryable=True)
    if isinstance(exc, TimeoutError):
        return EngineRequestFailed(message, code="engine_timeout", status_code=504, retryable=True)
    if isinstance(exc, engine_errors.UnknownKVHandle):
        return EngineRequestFailed(message, code="kv_handle_unknown")
    if isinstance(exc, engine_errors.KVLeaseExpired):
        return EngineRequestFailed(message, code="kv_lease_expired")
    if isinstance(exc, engine_errors.ProducerUnavailable):
        return EngineRequestFailed(message, code="producer_unavailable", status_code=503)
    if isinstance(exc, engine_errors.KVTransferFailed):
        return EngineRequestFailed(message, code="kv_transfer_failed")
    if isinstance(exc, engine_errors.RequestAborted):
        return EngineRequestFailed(message, code="request_cancelled", status_code=503)
    if isinstance(exc, engine_errors.RequestError):
        return EngineRequestFailed(message, code="engine_error")
    if isinstance(exc, EngineUnreachable):
        return EngineRequestFailed(
            message, code="engine_unreachable", status_code=503, retryable=True
        )
    if isinstance(exc, ProtocolMismatch):
        return EngineRequestFailed(message, code="protocol_mismatch", retryable=True)
    # Anything else is a bug on our side of the connection; another engine may still work,
    # but the message is kept for the operator.
    logger.error("unexpected %s from an engine call: %s", type(exc).__name__, exc)
    return EngineRequestFailed(message, code="engine_error", retryable=True)
