"""The planned pull's reads from a prefill generation that left the control plane: they fail at
once, logged with both sides' blocks, and counted as failed transfers (vLLM's own pull worker
fails them uncounted). The vLLM worker surface the mixin calls is recorded by a stand-in; the
end-to-end case (a real prefill stopping before the decode reads) is in
tests/integration/engines/test_vllm_layouts.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def make_worker() -> Any:
    from services.engines.vllm._planned_pull import PlannedPullWorker  # noqa: PLC0415

    class VllmSurface:
        """What the mixin calls on vLLM's ``NixlPullConnectorWorker``, recorded."""

        def __init__(self) -> None:
            self._invalid_remote_engines: set[str] = set()
            self._remote_agents: dict[str, dict[Any, str]] = {}
            self._recv_failures: set[str] = set()
            self.invalidated: list[str] = []
            self.logged: list[tuple[str, str, str]] = []
            self.failed: list[tuple[str, bool]] = []
            self.handshakes: list[str] = []

        def _invalidate(self, engine_id: str) -> None:
            self.invalidated.append(engine_id)

        def _log_failure(self, failure_type: str, req_id: str, msg: str = "", **_: Any) -> None:
            self.logged.append((failure_type, req_id, msg))

        def _handle_failed_transfer(
            self, req_id: str, handle: Any, failed: set[str], record_failed_transfer: bool = True
        ) -> bool:
            self.failed.append((req_id, record_failed_transfer))
            failed.add(req_id)
            return True

        def _background_nixl_handshake(self, req_id: str, engine_id: str, meta: Any) -> None:
            self.handshakes.append(engine_id)

    class Worker(PlannedPullWorker, VllmSurface):
        def __init__(self) -> None:
            VllmSurface.__init__(self)
            self._pdserve_rank = (1, 0)
            self._pdserve_departed = set()
            self._pdserve_notices = {}

    return Worker()


def request(engine_id: str) -> SimpleNamespace:
    remote = SimpleNamespace(engine_id=engine_id, block_ids=[[4, 5]], request_id="pre-req")
    return SimpleNamespace(remote=remote, local_physical_block_ids=[[7, 8]])


def test_reads_from_a_departed_generation_fail_named_and_counted() -> None:
    worker = make_worker()
    worker._invalidate("prefill.g3")
    assert worker.invalidated == ["prefill.g3"]  # vLLM's invalidation still runs
    worker._read_blocks_for_req("req-1", request("prefill.g3"))
    [(failure_type, req_id, msg)] = worker.logged
    assert (failure_type, req_id) == ("producer_gone", "req-1")
    assert "prefill.g3" in msg and "[[4, 5]]" in msg and "[[7, 8]]" in msg
    assert worker.failed == [("req-1", True)]  # counted: vllm_transfer_failed
    assert worker._recv_failures == {"req-1"}
    assert worker.handshakes == []  # no handshake with a generation that never comes back


def test_a_generation_vllm_invalidated_fails_counted_too() -> None:
    worker = make_worker()
    worker._invalid_remote_engines.add("prefill.g4")
    worker._read_blocks_for_req("req-2", request("prefill.g4"))
    assert worker.failed == [("req-2", True)]


def test_an_unknown_live_generation_is_handshaken() -> None:
    worker = make_worker()
    worker._invalidate("prefill.g3")
    worker._read_blocks_for_req("req-3", request("prefill.g5"))  # the restarted prefill
    assert worker.handshakes == ["prefill.g5"] and worker.failed == []
