"""The router's engine-error table (services.router.errors.ENGINE_ERRORS): each engine error
class maps to its code, status and retryability, looked up along the class hierarchy."""

from __future__ import annotations

import logging

import pytest

from services.engines import errors as engine_errors
from services.router.errors import (
    ENGINE_ERRORS,
    EngineRequestFailed,
    InvalidRequestError,
    NoEngineAvailable,
    engine_error,
    engine_rule,
)
from services.serving.errors import EngineUnreachable, ProtocolMismatch

# (exception, code, HTTP status, retryable): the behaviour of the former isinstance ladder.
EXPECTED = [
    (engine_errors.EngineOverloaded("full"), "engine_overloaded", 503, True),
    (engine_errors.EngineDraining("bye"), "engine_draining", 503, True),
    (engine_errors.EngineFailed("rank died"), "engine_failed", 502, True),
    (TimeoutError("slow"), "engine_timeout", 504, True),
    (engine_errors.UnknownKVHandle("gone"), "kv_handle_unknown", 502, False),
    (engine_errors.KVLeaseExpired("late"), "kv_lease_expired", 502, False),
    (engine_errors.ProducerUnavailable("down"), "producer_unavailable", 503, False),
    (
        engine_errors.KVTransferFailed("pull", "remote_disconnected"),
        "kv_transfer_failed",
        502,
        False,
    ),
    (engine_errors.RequestAborted("abort"), "request_cancelled", 503, True),
    (engine_errors.DuplicateRequest("twice"), "engine_error", 502, False),
    (EngineUnreachable("refused", "h:1"), "engine_unreachable", 503, True),
    (ProtocolMismatch("wrong role"), "protocol_mismatch", 502, True),
]


@pytest.mark.parametrize(("exc", "code", "status", "retryable"), EXPECTED)
def test_each_engine_error_maps_to_its_code_status_and_retryability(
    exc: Exception, code: str, status: int, retryable: bool
) -> None:
    error = engine_error(exc, stage="decode")
    assert isinstance(error, EngineRequestFailed)
    assert (error.code, error.status_code, error.retryable) == (code, status, retryable)
    assert error.message.startswith("decode failed: ")


def test_every_request_scoped_engine_error_class_has_a_row_or_inherits_one() -> None:
    classes = [
        cls
        for cls in vars(engine_errors).values()
        if isinstance(cls, type) and issubclass(cls, engine_errors.RequestError)
    ]
    assert len(classes) > 5
    for cls in [*classes, engine_errors.EngineFailed]:
        assert engine_rule(cls.__new__(cls)) is not None, cls


def test_bad_input_is_the_clients_400_without_the_stage_prefix() -> None:
    error = engine_error(engine_errors.InvalidRequest("top_k must be positive"), stage="prefill")
    assert isinstance(error, InvalidRequestError)
    assert (error.status_code, error.code, error.message) == (
        400,
        "invalid_request",
        "top_k must be positive",
    )


def test_the_most_specific_listed_class_wins() -> None:
    class LatePull(engine_errors.KVLeaseExpired):
        pass

    class OddRequestError(engine_errors.RequestError):
        pass

    assert engine_error(LatePull("x"), stage="decode").code == "kv_lease_expired"
    # RequestError's row is the fallback of request-scoped errors without one of their own.
    assert engine_rule(OddRequestError("x")) is ENGINE_ERRORS[engine_errors.RequestError]
    assert engine_error(OddRequestError("x"), stage="decode").code == "engine_error"


def test_an_unlisted_exception_is_a_logged_retryable_engine_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="services.router.errors"):
        error = engine_error(KeyError("oops"), stage="prefill")
    assert isinstance(error, EngineRequestFailed)
    assert (error.code, error.status_code, error.retryable) == ("engine_error", 502, True)
    assert "unexpected KeyError" in caplog.text
    # An empty message names the class instead.
    assert engine_error(RuntimeError(), stage="decode").message == "decode failed: RuntimeError"


def test_a_router_error_passes_through_unchanged() -> None:
    original = NoEngineAvailable("none")
    assert engine_error(original, stage="prefill") is original
