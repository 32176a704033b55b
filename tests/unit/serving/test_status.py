"""Engine errors <-> gRPC status codes: the table both ends share."""

from __future__ import annotations

import grpc
import pytest

from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineFailed,
    EngineOverloaded,
    InvalidRequest,
    KVLeaseExpired,
    KVTransferFailed,
    ProducerUnavailable,
    RequestAborted,
    UnknownKVHandle,
)
from services.router.errors import engine_error
from services.serving.errors import EngineUnreachable, ProtocolMismatch
from services.serving.wire.status import error_from_status, status_for

CASES = [
    (InvalidRequest("max_tokens must be at least 1"), grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequest("req-1 running"), grpc.StatusCode.ALREADY_EXISTS),
    (UnknownKVHandle("no KV for req-1"), grpc.StatusCode.NOT_FOUND),
    (KVLeaseExpired("lease ran out"), grpc.StatusCode.FAILED_PRECONDITION),
    (ProducerUnavailable("prefill-a not READY"), grpc.StatusCode.UNAVAILABLE),
    (KVTransferFailed("pull failed", "remote_disconnected"), grpc.StatusCode.UNAVAILABLE),
    (EngineDraining("draining"), grpc.StatusCode.UNAVAILABLE),
    (EngineOverloaded("KV pool full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted("aborted"), grpc.StatusCode.CANCELLED),
    (EngineFailed("rank 1 died"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize(("error", "code"), CASES, ids=[type(e).__name__ for e, _ in CASES])
def test_each_error_maps_to_its_code_and_back_to_its_class(
    error: Exception, code: grpc.StatusCode
) -> None:
    sent_code, details, metadata = status_for(error)
    assert sent_code is code
    back = error_from_status(sent_code, details, metadata, target="10.0.0.1:50051", rpc="Decode")
    assert type(back) is type(error)
    assert str(error) in str(back)
    assert "10.0.0.1:50051" in str(back)
    if isinstance(error, KVTransferFailed):
        assert isinstance(back, KVTransferFailed)
        assert back.reason == "remote_disconnected"


def test_unexpected_exception_is_internal_not_unknown() -> None:
    code, details, _ = status_for(RuntimeError("boom"))
    assert code is grpc.StatusCode.INTERNAL
    assert "boom" in details


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED],
)
def test_transport_failures_without_metadata_are_unreachable(code: grpc.StatusCode) -> None:
    error = error_from_status(code, "failed to connect", (), target="h:1", rpc="Prefill")
    assert isinstance(error, EngineUnreachable)
    assert error.target == "h:1"


def test_metadata_that_disagrees_with_the_code_is_ignored() -> None:
    # A hostile or confused peer cannot make UNAVAILABLE read as an InvalidRequest.
    error = error_from_status(
        grpc.StatusCode.UNAVAILABLE,
        "x",
        (("pdserve-error", "InvalidRequest"),),
        target="h:1",
        rpc="Decode",
    )
    assert isinstance(error, EngineUnreachable)


def test_unimplemented_is_a_protocol_mismatch() -> None:
    error = error_from_status(grpc.StatusCode.UNIMPLEMENTED, "", (), target="h:1", rpc="Prefill")
    assert isinstance(error, ProtocolMismatch)


def test_grpc_message_size_limit_is_invalid_request() -> None:
    error = error_from_status(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "message larger than max",
        (),
        target="h:1",
        rpc="Prefill",
    )
    assert isinstance(error, InvalidRequest)


def test_bare_cancelled_is_request_aborted_and_the_router_answers_503() -> None:
    # One class for an aborted request whichever backend reported it (the reference engine
    # raises RequestAborted; a stub or vLLM prefill returning ABORT is raised as it by the
    # servicer), so the router's mapping sees one class.
    error = error_from_status(grpc.StatusCode.CANCELLED, "", (), target="h:1", rpc="Prefill")
    assert isinstance(error, RequestAborted)
    routed = engine_error(error, stage="prefill")
    assert routed.code == "request_cancelled"
    assert routed.status_code == 503
