"""NIXL exceptions are translated at one boundary, with one table."""

from __future__ import annotations

import nixl._bindings as bindings
import pytest

from services.kv_transfer.errors import (
    KVTransferError,
    PullSpecError,
    RemoteDisconnectedError,
    TransferError,
    TransportFatalError,
    map_nixl_errors,
)


def test_remote_disconnect_maps_to_its_own_type():
    with pytest.raises(RemoteDisconnectedError) as info, map_nixl_errors("post transfer"):
        raise bindings.nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
    assert info.value.reason == "remote_disconnected"
    assert "post transfer" in str(info.value)
    assert isinstance(info.value.__cause__, bindings.nixlRemoteDisconnectError)


@pytest.mark.parametrize(
    ("name", "reason"),
    [("nixlBackendError", "backend_error"), ("nixlNotFoundError", "not_found")],
)
def test_other_nixl_errors_are_transfer_errors_with_a_reason(name: str, reason: str):
    with pytest.raises(TransferError) as info, map_nixl_errors("read"):
        raise getattr(bindings, name)("boom")
    assert info.value.reason == reason


def test_fatal_operations_raise_the_process_fatal_error():
    with pytest.raises(TransportFatalError), map_nixl_errors("register", fatal=True):
        raise bindings.nixlBackendError("no memory")
    with pytest.raises(TransportFatalError), map_nixl_errors("create agent", fatal=True):
        raise RuntimeError("No plugins available for NIXL")


def test_our_own_errors_and_foreign_errors_pass_through():
    with pytest.raises(PullSpecError), map_nixl_errors("x"):
        raise PullSpecError("bad pull")
    with pytest.raises(KeyError), map_nixl_errors("x"):
        raise KeyError("not nixl")
    assert issubclass(TransportFatalError, KVTransferError)
