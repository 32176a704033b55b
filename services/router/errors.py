"""Errors of the router, each answered with the OpenAI error envelope by one handler.

::

    RouterError                        every request-scoped router error (status, type, code)
    ├── InvalidRequestError        400  a bad or unsupported parameter (``param`` names it)
    ├── AuthenticationError        401  missing or wrong API key
    ├── ModelNotFound              404  a model the router does not serve (its outcome label)
    ├── NoEngineAvailable          503  no usable READY engine (or pair) for the served model
    └── EngineRequestFailed        502  an engine failed the request (``code`` says how);
                                        503 when it is overloaded or draining

``code`` doubles as the ``outcome`` label of ``pdserve_router_requests_total``. Engine errors
(:mod:`services.engines.errors`, ``services.serving.errors.EngineUnreachable``) are translated
to these at one place, :func:`engine_error`, by one table (:data:`ENGINE_ERRORS`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

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


class RequestTooLarge(RouterError):
    """A request body over ``max_request_body_bytes``."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"

    @classmethod
    def of_body(cls, size: int, limit: int) -> RequestTooLarge:
        """The error of a body of ``size`` bytes (or more: it was not read whole) over
        ``limit``."""
        return cls(
            f"the request body ({size} bytes or more) is larger than this server accepts "
            f"({limit} bytes, PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES)"
        )


class TooManyRequests(RouterError):
    """Too many requests at once: try again (the outcome a 429 answer counts under)."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


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


CLIENT_DISCONNECTED = "client_disconnected"
"""The outcome of a request whose client hung up before its answer ended."""

OUTCOME_OF_STATUS: Mapping[int, str] = MappingProxyType(
    {
        error.status_code: error.code
        for error in (
            InvalidRequestError,
            AuthenticationError,
            ModelNotFound,
            RequestTooLarge,
            TooManyRequests,
            RouterError,
        )
    }
)
"""An HTTP error status -> the ``outcome`` its router error counts under, for an answer whose
error the router did not raise itself (vLLM's front end validating a request, say). Statuses
that several router errors share (502, 503: engine errors by reason) are not guessed."""


def outcome_of_status(status: int) -> str:
    """The ``outcome`` label of an answer with HTTP ``status`` whose error code is not known:
    ``ok`` below 400, the router error of that status (:data:`OUTCOME_OF_STATUS`), else
    ``http_<status>``."""
    if status < 400:
        return "ok"
    return OUTCOME_OF_STATUS.get(status, f"http_{status}")


@dataclass(frozen=True)
class EngineErrorRule:
    """How one class of engine-call exception is answered: the router error's ``code``, its
    HTTP status and whether another engine may succeed (``retryable``). ``client`` marks the
    client's own mistake: an :class:`InvalidRequestError` (400) with the engine's message."""

    code: str
    status_code: int = 502
    retryable: bool = False
    client: bool = False


ENGINE_ERRORS: Mapping[type[BaseException], EngineErrorRule] = MappingProxyType(
    {
        engine_errors.InvalidRequest: EngineErrorRule("invalid_request", 400, client=True),
        engine_errors.EngineOverloaded: EngineErrorRule("engine_overloaded", 503, True),
        engine_errors.EngineDraining: EngineErrorRule("engine_draining", 503, True),
        engine_errors.EngineFailed: EngineErrorRule("engine_failed", retryable=True),
        TimeoutError: EngineErrorRule("engine_timeout", 504, True),
        engine_errors.EngineStalled: EngineErrorRule("engine_timeout", 504, True),
        engine_errors.UnknownKVHandle: EngineErrorRule("kv_handle_unknown"),
        engine_errors.KVLeaseExpired: EngineErrorRule("kv_lease_expired"),
        engine_errors.ProducerUnavailable: EngineErrorRule("producer_unavailable", 503),
        engine_errors.KVTransferFailed: EngineErrorRule("kv_transfer_failed"),
        engine_errors.RequestAborted: EngineErrorRule("request_cancelled", 503, True),
        engine_errors.RequestError: EngineErrorRule("engine_error"),
        EngineUnreachable: EngineErrorRule("engine_unreachable", 503, True),
        ProtocolMismatch: EngineErrorRule("protocol_mismatch", retryable=True),
    }
)
"""The one table from engine-call exceptions to router errors, looked up along the exception's
class hierarchy (its MRO: the most specific class listed wins, so ``RequestError`` is the
fallback of every request-scoped engine error without a row of its own). ``retryable`` marks
the failures another engine may not have (overloaded, draining, unreachable, failed, timed
out, or aborted by the engine: a prefill the router still waits on ends CANCELLED only when its
engine gave it up, as a host ending on a rank's death does); bad input is the client's (400)
and never retried."""

UNEXPECTED = EngineErrorRule("engine_error", retryable=True)
"""Anything the table does not list: a bug on our side of the connection; another engine may
still work, and the message is logged for the operator."""


def engine_rule(exc: BaseException) -> EngineErrorRule | None:
    """The row of :data:`ENGINE_ERRORS` for ``exc``'s most specific listed class, if any."""
    for cls in type(exc).__mro__:
        rule = ENGINE_ERRORS.get(cls)
        if rule is not None:
            return rule
    return None


def engine_error(exc: Exception, *, stage: str) -> RouterError:
    """Translate an engine call's exception into the router's error by :data:`ENGINE_ERRORS`
    (a :class:`RouterError` is returned as it is)."""
    if isinstance(exc, RouterError):
        return exc
    rule = engine_rule(exc)
    if rule is None:
        logger.error("unexpected %s from an engine call: %s", type(exc).__name__, exc)
        rule = UNEXPECTED
    if rule.client:
        return InvalidRequestError(str(exc))
    message = f"{stage} failed: {exc}" if str(exc) else f"{stage} failed: {type(exc).__name__}"
    return EngineRequestFailed(
        message, code=rule.code, status_code=rule.status_code, retryable=rule.retryable
    )
