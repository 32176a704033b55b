"""The KV data plane: paged block pools, pre-warmed peer-to-peer pulls over NIXL, completion.

Start at :mod:`services.kv_transfer.transport` (the seam and its protocol, step by step), then
:mod:`~services.kv_transfer.block_pool` (the memory), :mod:`~services.kv_transfer.consumer` and
:mod:`~services.kv_transfer.producer` (what an engine drives),
:mod:`~services.kv_transfer.completion` (when a request is received / may be freed),
:mod:`~services.kv_transfer.planning` (who reads and who notifies whom) and
:mod:`~services.kv_transfer.nixl_transport` (the NIXL implementation, over
:mod:`~services.kv_transfer.nixl_agent`, the one module that calls NIXL).

This package imports neither torch nor NIXL: import :mod:`~services.kv_transfer.block_pool`
(torch) and :mod:`~services.kv_transfer.nixl_transport` (NIXL, loaded when a transport is built)
where they are used. It never talks to Redis: it takes
:class:`~services.control_plane.wire.HandshakeRecord` and
:class:`~services.control_plane.aggregation.EngineTopology` values.
"""

from services.kv_transfer.errors import (
    BlockPoolError,
    BlockStateError,
    CompletionError,
    DuplicateReportError,
    IncompatiblePeerError,
    KVTransferError,
    LeaseError,
    NotificationDecodeError,
    PeerError,
    PoolExhaustedError,
    PullSpecError,
    RemoteDisconnectedError,
    StaleGenerationError,
    TransferError,
    TransferTimeoutError,
    TransportFatalError,
    UnknownPeerError,
    UnknownRankError,
)
from services.kv_transfer.protocol import (
    BlockIds,
    KVNotification,
    RequestId,
    WorkerIdentity,
    rank_label,
)

__all__ = [
    "BlockIds",
    "BlockPoolError",
    "BlockStateError",
    "CompletionError",
    "DuplicateReportError",
    "IncompatiblePeerError",
    "KVNotification",
    "KVTransferError",
    "LeaseError",
    "NotificationDecodeError",
    "PeerError",
    "PoolExhaustedError",
    "PullSpecError",
    "RemoteDisconnectedError",
    "RequestId",
    "StaleGenerationError",
    "TransferError",
    "TransferTimeoutError",
    "TransportFatalError",
    "UnknownPeerError",
    "UnknownRankError",
    "WorkerIdentity",
    "rank_label",
]
