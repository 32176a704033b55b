"""How an engine's model is cut across its PP x TP workers, and which KV each worker reads.

Pure code: no I/O, no third-party imports. Everything else (control plane, KV data plane,
engines) speaks in these types.
"""

from services.topology.plan import PlannedRead, plan_reads
from services.topology.ranges import (
    EngineLayout,
    Range,
    WorkerShard,
    kv_head_range,
    split_layers,
)
from services.topology.shape import ModelShape

__all__ = [
    "EngineLayout",
    "ModelShape",
    "PlannedRead",
    "Range",
    "WorkerShard",
    "kv_head_range",
    "plan_reads",
    "split_layers",
]
