"""The engine-backend seam: what a prefill or decode service asks of the engine it hosts.

A service (``pdserve prefill`` / ``pdserve decode``) owns one :class:`EngineBackend`. The
reference CPU engine (``services.engines.reference``) and the vLLM engine
(``services.engines.vllm``) implement it; the gRPC layer translates its types to and from
``proto/pdserve/v1`` and its errors (:mod:`services.engines.errors`) to status codes.

Lifecycle, as the host drives it:

1. ``backend = SomeBackend(options)``; :meth:`EngineBackend.describe` gives the
   :class:`~services.control_plane.base.EngineSpec` fields that depend on the model and layout
   (the host fills in engine id, role and endpoint) without starting anything heavy.
2. The host registers the spec with the control plane and gets a generation.
3. ``await backend.start(registration)`` starts the engine's rank processes; every
   ``(pp_rank, tp_rank)`` publishes its handshake record for ``registration.generation``
   (or the engine's scheduler publishes the whole grid). ``start`` returns once every rank is
   up and has published; the host then waits for READY through the control plane.
4. Requests: :meth:`prefill`, :meth:`decode`, :meth:`abort`; :meth:`load` on every heartbeat.
   If the control plane lost the registration (a heartbeat got ``EngineNotFound``: Redis
   restarted without persistence, or the lease ran out), the host registers the same spec
   again and calls :meth:`republish` with the new generation; the engine keeps running.
5. Shutdown: :meth:`drain` (stop admitting, finish or abort in-flight work within a bound),
   then :meth:`stop`.

Every method is safe to call from the host's asyncio loop; a backend never blocks it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.config.control_plane import ControlPlaneSettings
from services.control_plane.aggregation import DTYPE_BYTES
from services.control_plane.base import EngineSpec
from services.control_plane.wire import (
    EngineId,
    EngineLoad,
    EngineRole,
    Generation,
    record_shape,
)
from services.engines.errors import LoRANotServed
from services.engines.lora import LoRAAdapter
from services.engines.requests import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta
from services.kv_events.endpoints import advertised
from services.topology import ModelShape


@dataclass(frozen=True)
class EngineRegistration:
    """What :meth:`EngineBackend.start` needs to publish handshakes for this engine."""

    engine_id: EngineId
    generation: Generation
    role: EngineRole
    control_plane: ControlPlaneSettings = field(default_factory=ControlPlaneSettings)


@dataclass(frozen=True)
class BackendDescription:
    """The model- and layout-dependent parts of an engine's control-plane spec: the model's
    shape (the spec carries the part a record does: ``control_plane.wire.record_shape``) and
    what else the backend knows before it has an id or an address."""

    model: str
    compat_hash: str
    shape: ModelShape
    eos_token_ids: tuple[int, ...]
    pp_aware: bool = True
    engine_kind: str = "reference"
    kv_events_endpoint: str = ""
    """Where the engine publishes its KV-cache events, as bound (``tcp://*:PORT`` binds every
    interface; :meth:`spec` puts the host's advertised host in place of the wildcard); empty =
    no events. A backend that publishes binds (or reserves) its ports by :meth:`describe`."""
    kv_events_replay_endpoint: str = ""
    """The KV-event replay endpoint, as bound (same rules)."""
    kv_block_bytes: int = 0
    """The bytes of one KV block of the whole engine (:func:`kv_block_bytes`); 0 = unknown."""
    max_loras: int = 0
    """LoRA adapters the engine runs at once (vLLM's ``max_loras``); 0 = it serves none."""

    def spec(self, engine_id: EngineId, role: EngineRole, endpoint: str) -> EngineSpec:
        """The control-plane spec of an engine with this description (what the host registers):
        ``endpoint`` is the advertised gRPC ``HOST:PORT``, whose host also replaces a wildcard
        in the KV-event endpoints."""
        shared = {f.name for f in dataclasses.fields(EngineSpec)} - SPEC_ONLY_FIELDS
        values = {name: getattr(self, name) for name in shared}
        values["shape"] = record_shape(self.shape)
        host = endpoint.rpartition(":")[0] or endpoint
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if values[name]:
                values[name] = advertised(values[name], host)
        return EngineSpec(engine_id=engine_id, role=role, endpoint=endpoint, **values)


def kv_block_bytes(shape: ModelShape) -> int:
    """The bytes of one KV block of a whole engine: K and V of every layer and KV head, in the
    KV cache's dtype (0 for a dtype :data:`DTYPE_BYTES` does not know)."""
    element = DTYPE_BYTES.get(shape.dtype, 0)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.block_size * shape.head_size * element


SPEC_ONLY_FIELDS = frozenset({"engine_id", "role", "endpoint"})
"""The fields of :class:`EngineSpec` a description does not have (the host knows them)."""


class EngineBackend(abc.ABC):
    """An engine a service hosts. See the module docstring for the lifecycle.

    Errors: :class:`~services.engines.errors.InvalidRequest` for bad input (never a crash),
    :class:`~services.engines.errors.UnknownKVHandle` / ``KVLeaseExpired`` /
    ``ProducerUnavailable`` for a handle that cannot be pulled, ``EngineOverloaded`` when
    admission is refused, ``EngineDraining`` once :meth:`drain` began, ``EngineFailed`` when a
    rank died (the engine is then unusable and the host must exit non-zero).
    """

    forks_decode: bool = False
    """Whether :meth:`prefill` takes ``sampling.n > 1`` and :meth:`decode` takes
    ``DecodeRequest.forks`` (n choices from one prefill and one KV transfer); a backend
    without it refuses both with :class:`~services.engines.errors.InvalidRequest`."""

    @abc.abstractmethod
    def describe(self) -> BackendDescription:
        """The spec fields the host registers; cheap (reads the model config only), except
        that a backend that publishes KV events binds or reserves their ports on the first
        call (the same endpoints every call after; :meth:`stop` releases them)."""

    @abc.abstractmethod
    async def start(self, registration: EngineRegistration) -> None:
        """Start every rank and have each publish its handshake record for the generation.

        Returns when all ranks are up and published; raises ``EngineFailed`` if one fails to
        start (every started rank is stopped first).
        """

    @abc.abstractmethod
    async def republish(self, registration: EngineRegistration) -> None:
        """Publish every rank's handshake record again, under ``registration.generation``.

        Called by the host (only after :meth:`start` returned) when the control plane lost
        the engine's registration and the host registered the same spec again: every rank
        publishes its handshake record again under the new generation (same agents, same
        memory), KV handles made from then on carry the new generation (those of the old one
        are refused by consumers: ``ProducerUnavailable``), and requests in flight keep
        running. ``registration`` differs from the started one only in ``generation``.

        Returns once every rank published; the host then waits for READY. Raises
        :class:`~services.control_plane.errors.ControlPlaneError` when a rank could not
        publish through the control plane (the host retries with a fresh registration) and
        ``EngineFailed`` when this engine cannot re-publish at all (the host exits non-zero).
        """

    @abc.abstractmethod
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Compute the prompt's KV and first token; hold the KV for a consumer (prefill role).

        ``request`` is valid (see :class:`PrefillRequest`); an engine whose role does not
        produce KV raises :class:`~services.engines.errors.InvalidRequest`. An abort before
        the first token raises :class:`~services.engines.errors.RequestAborted`."""

    @abc.abstractmethod
    def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        """Stream a request's tokens until it finishes; the last delta carries the reason.

        ``request`` is valid (see :class:`DecodeRequest`). The producer check has one owner,
        the Decode RPC (:class:`services.decode.servicer.ProducerGate`): before it calls
        ``decode`` with a ``kv_handle`` it has read the handle's producer from the control
        plane and refused the call unless the producer is a READY KV producer at the handle's
        generation with this engine's compat hash and block size
        (:func:`~services.engines.producer_check.producer_refusal`). A backend never reads the
        control plane for this; an in-process caller (a benchmark, an engine test) hands it
        only handles of producers it knows to be READY. What only the backend can tell it
        still refuses: a handle it cannot pull (``UnknownKVHandle``, an expired lease:
        ``KVLeaseExpired``, a pull that failed: ``ProducerUnavailable`` /
        ``KVTransferFailed``), raised before the first delta. Closing the iterator early
        aborts the request and frees its blocks.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Abort a running or held request and free its blocks; ``False`` when unknown."""

    @abc.abstractmethod
    def load(self) -> EngineLoad:
        """Queue depth, running requests and KV blocks (free, total) right now."""

    @abc.abstractmethod
    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to ``timeout_s`` for in-flight ones (held KV included)
        and abort what remains. Returns the number of requests aborted."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop every rank and withdraw its handshake. Idempotent."""

    async def load_lora(self, adapter: LoRAAdapter, *, replace: bool = False) -> tuple[str, ...]:
        """Load ``adapter`` (again under its name with ``replace``, or when its path changed)
        so requests naming it run without loading it first; returns the names of the adapters
        the engine holds after. A failed load leaves what the engine held as it was. Raises
        :class:`~services.engines.errors.LoRANotServed` on an engine without LoRA slots (this
        default), ``LoRAAdapterNotFound`` for a folder with no adapter, ``InvalidRequest``
        for one the engine refuses (the message is the engine's)."""
        raise LoRANotServed(
            f"the {self.describe().engine_kind} engine serves no LoRA adapter "
            f"(asked to load {adapter.name!r})"
        )

    async def unload_lora(self, name: str) -> bool:
        """Unload adapter ``name``; ``False`` when the engine does not hold it. Raises
        :class:`~services.engines.errors.LoRANotServed` on an engine without LoRA slots."""
        raise LoRANotServed(
            f"the {self.describe().engine_kind} engine serves no LoRA adapter "
            f"(asked to unload {name!r})"
        )

    @abc.abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (the prefill's first token, for the router)."""
