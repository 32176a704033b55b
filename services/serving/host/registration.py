"""An engine's registration in the control plane: the control-plane half of
:class:`~services.serving.host.engine_host.EngineHost`.

:class:`EngineRegistrar` registers the engine's spec, keeps its lease (:meth:`heartbeat`,
with the backend's load), waits until its handshake grid is READY (:meth:`wait_ready`) and,
when the control plane loses the registration while the engine serves, registers it again
and has the backend republish (:meth:`_reregister`). Fatal outcomes (a takeover by another
process, a lost registration before READY, a failed backend) go to the host's ``on_fatal``;
the host owns the process lifecycle and the gRPC/metrics servers.

A heartbeat that renews the lease later than half its TTL after the previous one is counted
(``pdserve_engine_heartbeat_failures_total{reason="late"}``) and logged with where the time
went (the Redis call, or the host: its event loop blocked or its process starved of CPU),
before it costs the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health_pb2

from services.control_plane import (
    ControlPlane,
    ControlPlaneError,
    ControlPlaneMetrics,
    EngineNotFound,
    EngineSpec,
    StaleGenerationError,
)
from services.control_plane.wire import EngineLoad, EngineState, EngineStatus
from services.engines.backend import EngineBackend, EngineRegistration
from services.engines.errors import EngineFailed
from services.serving.errors import HostError, ReadinessFailed, RegistrationLost
from services.serving.host.config import EngineServiceSettings
from services.serving.host.metrics import EngineServiceMetrics
from services.serving.host.servicer import ServingState

logger = logging.getLogger(__name__)

READY_POLL_S = 0.1


class RegistrationVanished(RegistrationLost):
    """The registration is gone while waiting for READY (not replaced by another process):
    fatal at start-up, retried during a re-registration."""


class HeartbeatLateness:
    """Whether a lease renewal came later than half the lease after the previous one, and
    where the time went. The clock starts at construction (the registration)."""

    def __init__(self, lease_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._last = clock()

    def calling(self) -> float:
        """Call before the heartbeat call; pass the result to :meth:`renewed`."""
        return self._clock()

    def renewed(self, call_started: float) -> str | None:
        """After a successful heartbeat: ``None`` when on time, else what happened."""
        now = self._clock()
        gap, call = now - self._last, now - call_started
        self._last = now
        if gap <= self.lease_ttl_s / 2:
            return None
        return (
            f"the lease (TTL {self.lease_ttl_s:.1f}s) was renewed {gap:.1f}s after the previous "
            f"renewal: the Redis call took {call:.1f}s, the host {gap - call:.1f}s before it "
            "(the heartbeat interval, plus its event loop blocked or its process starved of CPU)"
        )


class EngineRegistrar:
    """Registration, lease, READY wait and re-registration of one engine (module docstring).

    ``on_fatal`` receives the first fatal error (the host stops serving); ``set_health``
    sets the gRPC health of every service; ``on_reregistered`` gets the new generation once
    READY again; ``failure`` reads the backend's own failure (a dead rank) on every beat.
    """

    def __init__(
        self,
        *,
        engine_id: str,
        settings: EngineServiceSettings,
        control_plane: ControlPlane,
        backend: EngineBackend,
        metrics: EngineServiceMetrics,
        control_plane_metrics: ControlPlaneMetrics,
        failure: Callable[[], EngineFailed | None],
        on_fatal: Callable[[HostError | EngineFailed], None],
        set_health: Callable[
            [health_pb2.HealthCheckResponse.ServingStatus.ValueType], Awaitable[None]
        ],
        on_reregistered: Callable[[int], None],
    ) -> None:
        self.engine_id = engine_id
        self.settings = settings
        self.control_plane = control_plane
        self.backend = backend
        self.metrics = metrics
        self._control_plane_metrics = control_plane_metrics
        self._failure = failure
        self._on_fatal = on_fatal
        self._set_health = set_health
        self._on_reregistered = on_reregistered
        self._spec: EngineSpec | None = None
        self._backend_started = False
        self._restored_while_starting = False

    async def register(self, spec: EngineSpec) -> int:
        """Register ``spec``; its generation (kept for re-registrations)."""
        self._spec = spec
        record = await self.control_plane.register(spec)
        return record.generation

    def load(self) -> EngineLoad | None:
        try:
            load = self.backend.load()
        except Exception:
            logger.exception("load() of %s failed; heartbeat without load", self.engine_id)
            return None
        self.metrics.observe_load(load)
        return load

    def registration(self, generation: int) -> EngineRegistration:
        """What the backend is started (or republishes) with for ``generation``."""
        assert self._spec is not None, "register() first"
        return EngineRegistration(
            engine_id=self.engine_id,
            generation=generation,
            role=self._spec.role,
            control_plane=self.settings.control_plane,
        )

    def _registration_lost(self, generation: int, exc: ControlPlaneError) -> None:
        self._on_fatal(
            RegistrationLost(
                f"engine {self.engine_id} generation {generation} lost its registration "
                f"({type(exc).__name__}: {exc}); it stops serving under it"
            )
        )

    async def heartbeat(self, state: ServingState) -> None:
        """Renew the lease every ``heartbeat_interval_s`` at ``state.generation``.

        ``StaleGenerationError`` (another process registered this engine id) is fatal.
        ``EngineNotFound`` while serving starts a re-registration (:meth:`_reregister`), while
        starting a restore under the same generation (:meth:`_restore`), each in its own task
        so that this loop keeps the new lease alive meanwhile; while draining it is fatal.
        Other control-plane errors (Redis down) are counted and retried at the next interval.
        """
        interval = self.settings.control_plane.heartbeat_interval_s
        lateness = HeartbeatLateness(self.settings.control_plane.lease_ttl_s)
        reregistration: asyncio.Task[None] | None = None
        try:
            while True:
                failure = self._failure()
                if failure is not None:
                    self._on_fatal(failure)
                    return
                if reregistration is not None and reregistration.done():
                    reregistration = None  # it reported any fatal error itself
                generation = state.generation
                try:
                    call_started = lateness.calling()
                    await self.control_plane.heartbeat(self.engine_id, generation, self.load())
                    late = lateness.renewed(call_started)
                    if late is not None:
                        self.metrics.count_heartbeat_failure("late")
                        logger.warning("heartbeat of %s: %s", self.engine_id, late)
                except StaleGenerationError as exc:
                    if generation == state.generation:
                        self._registration_lost(generation, exc)
                        return
                    # A re-registration moved to a newer generation during this call.
                except EngineNotFound as exc:
                    self.metrics.count_heartbeat_failure(exc.reason)
                    if reregistration is None:
                        if state.draining:
                            self._registration_lost(generation, exc)
                            return
                        recovery = (
                            self._reregister(state, generation, exc)
                            if state.admitting
                            else self._restore(generation, exc)
                        )
                        reregistration = asyncio.create_task(recovery, name="reregister")
                except ControlPlaneError as exc:
                    # Retries already happened inside the control plane (and were counted);
                    # the lease outlives a few misses, and a lost one shows up as
                    # EngineNotFound.
                    self.metrics.count_heartbeat_failure(exc.reason)
                    logger.warning("heartbeat of %s failed: %s", self.engine_id, exc)
                await asyncio.sleep(interval)
        finally:
            if reregistration is not None and not reregistration.done():
                reregistration.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reregistration

    async def backend_started(self, generation: int) -> None:
        """The host calls this once ``backend.start()`` returned. A registration restored
        while the backend started may have lost handshakes its ranks had published: if the
        grid is not complete, the backend republishes them (:meth:`_republish_if_incomplete`)."""
        self._backend_started = True
        if self._restored_while_starting:
            await self._republish_if_incomplete(generation)

    async def _restore(self, generation: int, lost: EngineNotFound) -> None:
        """Register the same spec again at ``generation`` (:meth:`ControlPlane.restore`): the
        lease ran out while the engine was starting (its host stalled past the TTL: a busy
        node, a long model load). The generation stays, so ranks started with it (vLLM's
        connector has it baked in) still publish into it. Redis unreachable is retried every
        heartbeat interval; a newer registration by another process is fatal."""
        assert self._spec is not None, "register() first"
        logger.warning(
            "engine %s generation %d: the lease ran out while the engine was starting (%s); "
            "restoring the registration under the same generation",
            self.engine_id,
            generation,
            lost,
        )
        interval = self.settings.control_plane.heartbeat_interval_s
        while True:
            try:
                await self.control_plane.restore(self._spec, generation)
                break
            except StaleGenerationError as exc:
                self._registration_lost(generation, exc)
                return
            except ControlPlaneError as exc:
                self.metrics.count_reregistration_failure(exc.reason)
                logger.warning(
                    "restoring %s failed (%s); retrying in %.1fs", self.engine_id, exc, interval
                )
            await asyncio.sleep(interval)
        self.metrics.count_registration_restore()
        self._restored_while_starting = True
        if self._backend_started:
            try:
                await self._republish_if_incomplete(generation)
            except (HostError, EngineFailed, ControlPlaneError) as exc:
                self._on_fatal(
                    exc
                    if isinstance(exc, HostError | EngineFailed)
                    else RegistrationLost(f"engine {self.engine_id} could not republish: {exc}")
                )

    async def _republish_if_incomplete(self, generation: int) -> None:
        view = await self.control_plane.get_engine(self.engine_id)
        if view is not None and view.generation == generation and view.state is EngineState.READY:
            return
        logger.warning(
            "engine %s generation %d: republishing the handshakes lost with the lease",
            self.engine_id,
            generation,
        )
        await self._republish(generation)

    async def _republish(self, generation: int) -> None:
        """``backend.republish`` at ``generation``, bounded by ``ready_timeout_s``."""
        try:
            await asyncio.wait_for(
                self.backend.republish(self.registration(generation)),
                self.settings.ready_timeout_s,
            )
        except TimeoutError as exc:
            raise ReadinessFailed(
                f"engine {self.engine_id} did not republish its handshakes within "
                f"{self.settings.ready_timeout_s}s"
            ) from exc

    async def _reregister(
        self, state: ServingState, lost_generation: int, lost: EngineNotFound
    ) -> None:
        """Register the same spec again, have every rank republish, wait for READY.

        Failed attempts (Redis still down, the new registration lost again) are counted and
        retried every heartbeat interval for as long as it takes; a takeover by another
        process, an engine that cannot republish, or a grid that does not turn READY within
        ``ready_timeout_s`` is fatal.
        """
        assert self._spec is not None, "register() first"
        logger.warning(
            "engine %s generation %d: the control plane lost its registration (%s); "
            "registering again and republishing the handshakes",
            self.engine_id,
            lost_generation,
            lost,
        )
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        interval = self.settings.control_plane.heartbeat_interval_s
        try:
            while True:
                try:
                    record = await self.control_plane.register(self._spec)
                    state.generation = record.generation
                    await self._republish(record.generation)
                    await self.wait_ready(record.generation)
                    break
                except StaleGenerationError as exc:
                    self._registration_lost(state.generation, exc)
                    return
                except (ControlPlaneError, RegistrationVanished) as exc:
                    reason = exc.reason if isinstance(exc, ControlPlaneError) else "vanished"
                    self.metrics.count_reregistration_failure(reason)
                    logger.warning(
                        "re-registering %s failed (%s); retrying in %.1fs",
                        self.engine_id,
                        exc,
                        interval,
                    )
                await asyncio.sleep(interval)
        except (HostError, EngineFailed) as exc:
            self._on_fatal(exc)
            return
        self.metrics.count_reregistration()
        self._on_reregistered(state.generation)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.warning(
            "engine %s READY again at generation %d (was %d)",
            self.engine_id,
            state.generation,
            lost_generation,
        )

    def _observe_readiness(self, status: EngineStatus | None) -> None:
        """Count the READY latency here: the process that completed the grid (a rank process,
        or vLLM's scheduler) exports nothing of the control plane's, the engine service does."""
        if status is not None and status.ready_latency_ms >= 0:
            self._control_plane_metrics.readiness_latency.labels(engine=self.engine_id).observe(
                status.ready_latency_ms / 1000
            )

    async def wait_ready(self, generation: int) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while True:
            inspection = await self.control_plane.inspect(self.engine_id)
            view = inspection.view if inspection else None
            if view is None:
                raise RegistrationVanished(
                    f"engine {self.engine_id} generation {generation} vanished from the control "
                    "plane before it was READY"
                )
            if view.generation != generation:
                raise RegistrationLost(
                    f"engine {self.engine_id} generation {generation} was replaced by "
                    f"generation {view.generation} before it was READY"
                )
            aggregation = inspection.aggregation if inspection else None
            if aggregation is not None:
                for pp_rank, tp_rank in aggregation.records:
                    self.metrics.rank_published(pp_rank, tp_rank)
            if view.state is EngineState.READY:
                self._observe_readiness(view.status)
                return
            if view.state is EngineState.INVALID:
                problems = "; ".join(view.status.problems if view.status else ()) or "unknown"
                raise ReadinessFailed(
                    f"engine {self.engine_id} handshake grid is INVALID: {problems}"
                )
            if time.monotonic() > deadline:
                missing = aggregation.missing if aggregation else ()
                raise ReadinessFailed(
                    f"engine {self.engine_id} not READY after {self.settings.ready_timeout_s}s"
                    + (f"; missing ranks {sorted(missing)}" if missing else "")
                )
            await asyncio.sleep(READY_POLL_S)
