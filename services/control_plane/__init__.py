"""The control plane: engine registry, leases, generations and handshake aggregation in Redis.

Start at :mod:`services.control_plane.base` (the seam and its protocol), then
:mod:`~services.control_plane.wire` (what is stored) and
:mod:`~services.control_plane.aggregation` (when an engine is READY).
"""

from services.control_plane.aggregation import Aggregation, EngineTopology, Problem, aggregate
from services.control_plane.base import (
    STOPPING_CALL_BOUND_S,
    AbstractEngineWatcher,
    ControlPlane,
    EngineChange,
    EngineInspection,
    EngineSpec,
    EngineView,
)
from services.control_plane.errors import (
    ControlPlaneError,
    ControlPlaneUnavailable,
    DuplicateRankError,
    EngineNotFound,
    EngineNotReady,
    HandshakeRejected,
    PipelineParallelUnsupported,
    RecordDecodeError,
    StaleGenerationError,
)
from services.control_plane.metrics import ControlPlaneMetrics
from services.control_plane.redis_store import RedisControlPlane
from services.control_plane.watch import EngineWatcher
from services.control_plane.wire import (
    PROTOCOL_VERSION,
    EngineLoad,
    EngineRecord,
    EngineRole,
    EngineState,
    EngineStatus,
    HandshakeRecord,
    compute_compat_hash,
)

__all__ = [
    "PROTOCOL_VERSION",
    "STOPPING_CALL_BOUND_S",
    "AbstractEngineWatcher",
    "Aggregation",
    "ControlPlane",
    "ControlPlaneError",
    "ControlPlaneMetrics",
    "ControlPlaneUnavailable",
    "DuplicateRankError",
    "EngineChange",
    "EngineInspection",
    "EngineLoad",
    "EngineNotFound",
    "EngineNotReady",
    "EngineRecord",
    "EngineRole",
    "EngineSpec",
    "EngineState",
    "EngineStatus",
    "EngineTopology",
    "EngineView",
    "EngineWatcher",
    "HandshakeRecord",
    "HandshakeRejected",
    "PipelineParallelUnsupported",
    "Problem",
    "RecordDecodeError",
    "RedisControlPlane",
    "StaleGenerationError",
    "aggregate",
    "compute_compat_hash",
]
