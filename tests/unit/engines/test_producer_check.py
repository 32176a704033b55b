"""``producer_refusal``: the one producer check of the Decode RPC's gate and the reference
backend."""

from __future__ import annotations

import pytest

from services.control_plane.base import EngineView
from services.control_plane.wire import EngineRecord, EngineRole, EngineState, EngineStatus
from services.engines.errors import InvalidRequest, ProducerUnavailable
from services.engines.producer_check import control_plane_refusal, producer_refusal
from services.engines.requests import KVHandle
from services.topology import ModelShape

HANDLE = KVHandle("prefill-a", 3, "req-1", (0, 1), 8, 2e9)


def view(
    *,
    generation: int = 3,
    state: EngineState = EngineState.READY,
    role: EngineRole = EngineRole.PREFILL,
    compat_hash: str = "c0",
    block_size: int = 4,
) -> EngineView:
    record = EngineRecord(
        "prefill-a",
        generation,
        role,
        "m",
        compat_hash,
        ModelShape(num_layers=7, num_kv_heads=2, block_size=block_size),
        "h:1",
        True,
        1,
        0,
    )
    status = EngineStatus("prefill-a", generation, state, (), 1, 0)
    return EngineView("prefill-a", record, status, None)


def test_a_ready_compatible_producer_at_the_handles_generation_is_not_refused() -> None:
    assert producer_refusal(view(), HANDLE, compat_hash="c0", block_size=4) is None
    assert producer_refusal(view(role=EngineRole.BOTH), HANDLE, compat_hash="c0") is None


@pytest.mark.parametrize(
    ("seen", "error", "reason"),
    [
        (None, ProducerUnavailable, "gone"),
        (view(generation=4), ProducerUnavailable, "stale_generation"),
        (view(state=EngineState.PENDING), ProducerUnavailable, "not_ready"),
        (view(role=EngineRole.DECODE), InvalidRequest, "not_a_producer"),
        (view(compat_hash="c1"), InvalidRequest, "incompatible"),
        (view(block_size=8), ProducerUnavailable, "block_size"),
    ],
)
def test_refusals_name_their_error_and_reason(
    seen: EngineView | None, error: type[Exception], reason: str
) -> None:
    refusal = producer_refusal(seen, HANDLE, compat_hash="c0", block_size=4)
    assert refusal is not None
    assert (refusal.error, refusal.reason) == (error, reason)
    assert isinstance(refusal.exception(), error)
    assert "prefill-a" in refusal.message


def test_block_sizes_are_compared_only_when_given() -> None:
    assert producer_refusal(view(block_size=8), HANDLE, compat_hash="c0") is None


def test_a_control_plane_error_is_producer_unavailable() -> None:
    refusal = control_plane_refusal("prefill-a", RuntimeError("down"))
    assert (refusal.error, refusal.reason) == (ProducerUnavailable, "control_plane")
