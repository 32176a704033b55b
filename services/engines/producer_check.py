"""Whether a KV handle's producer may be pulled from: one decision for every consumer.

A consumer (the Decode RPC's :class:`~services.decode.servicer.ProducerGate`, or a backend that
checks its handles itself) reads the producer's registration from the control plane and asks
:func:`producer_refusal`; ``None`` means the pull may start. The refusals, in order:

- ``gone``: the producer is not registered -> :class:`ProducerUnavailable`;
- ``stale_generation``: it is at another generation than the handle (it restarted or
  re-registered; that KV is gone or must not be read with old addresses) -> ``ProducerUnavailable``;
- ``not_ready``: its current generation is not READY -> ``ProducerUnavailable``;
- ``not_a_producer``: it is a decode engine -> :class:`InvalidRequest`;
- ``incompatible``: another model or KV format (compat hash) -> ``InvalidRequest``;
- ``block_size``: blocks of another size (checked when the consumer gives its own) ->
  ``ProducerUnavailable``.

A control-plane error while reading the registration is :func:`control_plane_refusal`
(``ProducerUnavailable``, reason ``control_plane``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.control_plane.base import EngineView
from services.control_plane.wire import EngineId
from services.engines.backend import KVHandle
from services.engines.errors import InvalidRequest, ProducerUnavailable, RequestError


@dataclass(frozen=True)
class Refusal:
    """Why a handle's producer cannot be pulled from: the error to raise and its metric label."""

    error: type[RequestError]
    reason: str
    message: str

    def exception(self) -> RequestError:
        return self.error(self.message)


def producer_refusal(
    view: EngineView | None,
    handle: KVHandle,
    *,
    compat_hash: str,
    block_size: int | None = None,
) -> Refusal | None:
    """What refuses a pull of ``handle`` given its producer's ``view``, or ``None``.

    ``compat_hash`` is the consumer's; ``block_size`` too, or ``None`` to not compare block
    sizes. Pure: reads nothing but its arguments.
    """
    producer = handle.producer_engine_id
    if view is None or view.record is None:
        return Refusal(ProducerUnavailable, "gone", f"producer engine {producer} is not registered")
    if view.generation != handle.generation:
        return Refusal(
            ProducerUnavailable,
            "stale_generation",
            f"producer engine {producer} is at generation {view.generation}, the handle names "
            f"generation {handle.generation} (it restarted; that KV is gone)",
        )
    if not view.ready:
        state = view.state.value if view.state else "unknown"
        return Refusal(
            ProducerUnavailable,
            "not_ready",
            f"producer engine {producer} is not READY (state {state})",
        )
    record = view.record
    if not record.role.produces_kv:
        return Refusal(
            InvalidRequest,
            "not_a_producer",
            f"engine {producer} is a decode engine, not a KV producer",
        )
    if record.compat_hash != compat_hash:
        return Refusal(
            InvalidRequest,
            "incompatible",
            f"producer engine {producer} serves an incompatible model or KV layout "
            f"(compat hash {record.compat_hash} != {compat_hash})",
        )
    if block_size is not None and record.block_size != block_size:
        return Refusal(
            ProducerUnavailable,
            "block_size",
            f"producer engine {producer} uses blocks of {record.block_size} tokens, this "
            f"engine {block_size}",
        )
    return None


def control_plane_refusal(producer: EngineId, error: Exception) -> Refusal:
    """The refusal when the producer's registration could not be read."""
    return Refusal(
        ProducerUnavailable,
        "control_plane",
        f"cannot confirm producer {producer} is READY: control plane error: {error}",
    )
