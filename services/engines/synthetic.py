"""What the engines without a model share: a synthetic grid, handles, tokens and text.

:class:`SyntheticEngine` is the base of the stub engine (:mod:`services.engines.stub`, instant)
and the simulated engine (:mod:`services.engines.sim`, GPU timing from a profile). Above it:
the two backends' admission, pacing and request bookkeeping. Below it: the control plane, where
it publishes one consistent handshake record per ``(pp, tp)`` with no NIXL agent behind them
(:mod:`services.control_plane.synthetic`), so the engine turns READY like any other. What never
crosses: KV bytes (a handle names blocks nobody can pull; a consumer trusts it).

Tokens are a pure function of the prompt: ``first = (sum(prompt) + len(prompt)) % vocab``, then
each next token is the previous one plus one (mod vocab), rendered as text ``" t<id>"``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from services.control_plane import ControlPlaneMetrics, EngineNotFound, RedisControlPlane
from services.control_plane.synthetic import synthetic_records
from services.engines.backend import BackendDescription, EngineBackend, EngineRegistration
from services.engines.errors import EngineFailed
from services.engines.requests import DecodeRequest, FinishReason, KVHandle, TokenDelta, Usage
from services.topology import ModelShape


@dataclass(frozen=True)
class SyntheticClaim:
    """The model and layout a synthetic engine claims (what it registers and publishes)."""

    engine_kind: str
    model: str
    compat_hash: str
    shape: ModelShape
    num_kv_blocks: int
    kv_lease_s: float
    kv_block_bytes: int = 0
    """The bytes of one KV block it claims (0 = unknown; the stub claims no KV geometry)."""


class SyntheticEngine(EngineBackend, abc.ABC):
    """Registration, republication, handles, tokens and text of an engine with no model.

    Subclasses implement admission and pacing (prefill, decode, abort, load), record the
    handles they give out with :meth:`_hold` (an abort of a held request finds it), refuse new
    requests once ``_draining`` and keep ``_idle`` set while nothing runs (:meth:`drain`).
    """

    def __init__(self, claim: SyntheticClaim) -> None:
        self.claim = claim
        self._registration: EngineRegistration | None = None
        self._control_plane: RedisControlPlane | None = None
        self._held: dict[str, float] = {}
        self._block_ids = itertools.count()
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def describe(self) -> BackendDescription:
        claim = self.claim
        return BackendDescription(
            model=claim.model,
            compat_hash=claim.compat_hash,
            shape=claim.shape,
            eos_token_ids=(),
            engine_kind=claim.engine_kind,
            kv_block_bytes=claim.kv_block_bytes,
        )

    async def start(self, registration: EngineRegistration) -> None:
        """Publish a synthetic grid (one call for every rank, as a vLLM scheduler would)."""
        self._registration = registration
        self._control_plane = RedisControlPlane(
            registration.control_plane, ControlPlaneMetrics(CollectorRegistry())
        )
        try:
            await self._publish(registration)
        except EngineNotFound as exc:
            raise EngineFailed(str(exc)) from exc

    async def republish(self, registration: EngineRegistration) -> None:
        """Publish the synthetic grid again under the new generation; handles made from now
        on name it."""
        current = self._require_registration()
        if (registration.engine_id, registration.role) != (current.engine_id, current.role):
            raise EngineFailed("republish must keep the engine id and role of start()")
        await self._publish(registration)
        self._registration = registration

    async def _publish(self, registration: EngineRegistration) -> None:
        kind = self.claim.engine_kind
        if self._control_plane is None:
            raise EngineFailed(f"{kind} engine used before start()")
        view = await self._control_plane.get_engine(registration.engine_id)
        if view is None or view.record is None or view.generation != registration.generation:
            raise EngineNotFound(
                f"{kind} engine {registration.engine_id} generation {registration.generation} "
                "is not registered"
            )
        records = synthetic_records(
            view.record,
            num_blocks=self.claim.num_kv_blocks,
            layer_partition=(
                list(self.claim.shape.layer_partition) if self.claim.shape.layer_partition else None
            ),
        )
        await self._control_plane.publish_handshakes(view.record, list(records.values()))

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting, let running and queued requests finish within ``timeout_s``, abort
        the rest; held handles are dropped (nothing real is held)."""
        self._draining = True
        self._held.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        aborted = 0
        for request_id in self._in_flight():
            aborted += await self.abort(request_id)
        # Aborted streams end at their next step; a consumer that stopped reading may never
        # take that step, and the host's server stop cancels it then.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), 5.0)
        return aborted

    @abc.abstractmethod
    def _in_flight(self) -> list[str]:
        """The requests running or queued now: what :meth:`drain` aborts when time is up."""

    async def stop(self) -> None:
        control_plane, self._control_plane = self._control_plane, None
        if control_plane is not None:
            with contextlib.suppress(Exception):
                await control_plane.close()

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return "".join(f" t{t}" for t in token_ids)

    def _first_token(self, prompt: Sequence[int]) -> int:
        return (sum(prompt) + len(prompt)) % self.claim.shape.vocab_size

    def _next_token(self, token: int) -> int:
        return (token + 1) % self.claim.shape.vocab_size

    @staticmethod
    def _last(request: DecodeRequest, generated: int, reason: FinishReason) -> TokenDelta:
        """A decode stream's last delta: no token, ``reason``, the usage of ``generated``."""
        usage = Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=generated)
        return TokenDelta((), "", reason, usage)

    def _hold(self, request_id: str, num_blocks: int, num_tokens: int) -> KVHandle:
        """A handle for ``request_id``'s KV under the current generation, remembered until
        its lease ends or it is aborted (nothing real is held)."""
        registration = self._require_registration()
        handle = KVHandle(
            producer_engine_id=registration.engine_id,
            generation=registration.generation,
            request_id=request_id,
            block_ids=tuple(
                next(self._block_ids) % self.claim.num_kv_blocks for _ in range(num_blocks)
            ),
            num_tokens=num_tokens,
            lease_expires_at_s=time.time() + self.claim.kv_lease_s,
        )
        self._held[request_id] = handle.lease_expires_at_s
        return handle

    def _drop_held(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None

    def _require_registration(self) -> EngineRegistration:
        if self._registration is None:
            raise EngineFailed(f"{self.claim.engine_kind} engine used before start()")
        return self._registration
