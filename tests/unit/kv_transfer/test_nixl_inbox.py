"""NixlTransport keeps the notifications its consumer-side progress fetched for the producer side.

The agent is real (its pool registered); only its notification fetch is replaced, to script
what arrives when.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.kv_transfer import nixl_transport
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.protocol import KVNotification, WorkerIdentity, encode_notification
from services.topology.ranges import Range


def notice(request_id: str) -> bytes:
    return encode_notification(KVNotification(request_id, "decode-a", 1, (0, 0), 1, True))


class ScriptedArrivals:
    """Stands in for ``NixlAgent.notifications``: each call returns the next batch."""

    def __init__(self, *batches: dict[str, list[bytes]]) -> None:
        self.batches = list(batches)
        self.calls = 0

    def __call__(self) -> dict[str, list[bytes]]:
        self.calls += 1
        return self.batches.pop(0) if self.batches else {}


@pytest.fixture
def transport() -> Iterator[NixlTransport]:
    pool = KVBlockPool(KVPoolSpec(Range(0, 2), Range(0, 1), 4, 4, 8))
    made = NixlTransport(pool, WorkerIdentity("prefill-a", 1, 0, 0))
    yield made
    made.close()


def test_poll_progresses_with_no_pull_pending_and_keeps_what_arrived(
    transport: NixlTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrivals = ScriptedArrivals(
        {"agent-1": [notice("req-a"), b"\xffnot msgpack"]}, {"agent-2": [notice("req-b")]}
    )
    monkeypatch.setattr(transport._agent, "notifications", arrivals)

    assert transport.poll() == []
    assert arrivals.calls == 1, "an idle poll must progress the agent"
    batch = transport.poll_notifications()

    assert [n.request_id for n in batch.received] == ["req-a", "req-b"]
    assert len(batch.rejected) == 1 and "agent-1" in batch.rejected[0]
    assert transport.poll_notifications().received == ()  # each notification is handed out once


def test_notifications_past_the_inbox_limit_are_dropped_and_reported(
    transport: NixlTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nixl_transport, "INBOX_LIMIT", 2)
    arrivals = ScriptedArrivals(
        {"agent-1": [notice("req-a"), notice("req-b")]},
        {"agent-1": [notice("req-c")]},
        {"agent-1": [notice("req-d"), notice("req-e"), notice("req-f")]},
    )
    monkeypatch.setattr(transport._agent, "notifications", arrivals)

    transport.poll()
    transport.poll()
    batch = transport.poll_notifications()

    assert [n.request_id for n in batch.received] == ["req-a", "req-b", "req-d", "req-e", "req-f"]
    assert batch.rejected == (
        "1 notifications dropped: more than 2 arrived between two polls of them",
    )
    assert transport.poll_notifications().rejected == ()
