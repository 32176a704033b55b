"""The RPC messages both ends read and write: proto <-> seam types (:mod:`.convert`,
:mod:`.fields`), engine errors <-> gRPC status (:mod:`.status`), the trace context as call
metadata (:mod:`.trace_metadata`)."""
