"""The engine host: what ``pdserve prefill`` and ``pdserve decode`` run.

The host owns the process lifecycle and the gRPC, health and metrics servers; the
control-plane half (register, heartbeat, READY wait, re-registration) is
:class:`~services.serving.host.registration.EngineRegistrar`.

Sequence (:meth:`EngineHost.run`):

1. ``backend.describe()``; bind the gRPC server (the role's service, handed over by the role
   package as a :class:`~services.serving.host.role.RoleService`; Engine; and the standard
   ``grpc.health.v1`` Health, NOT_SERVING) and ``/metrics``; nothing is admitted yet.
2. Register the :class:`EngineSpec` (endpoint = advertised gRPC address) -> generation; start
   heartbeating at once (model loading can outlast a lease) with ``backend.load()``.
3. ``backend.start(registration)``: ranks start and publish their handshakes.
4. Wait, bounded by ``ready_timeout_s``, until the control plane says READY: INVALID or the
   timeout is :class:`ReadinessFailed` (exit 1, the problems in the message).
5. Serve: admit requests, Health SERVING, print ``PDSERVE_READY {json}`` on stdout.
6. Until a stop request (SIGTERM/SIGINT in the CLI), a registration taken over by another
   process (heartbeat got ``StaleGenerationError``: exit 1, loudly) or a failed engine (exit 1).
   A heartbeat that fails because Redis is unreachable is logged, counted and retried: the
   lease outlives a few misses. A registration the control plane *lost* (``EngineNotFound``
   while serving: Redis restarted without persistence, or the lease ran out) is not fatal:
   the host registers the same spec again (new generation), ``backend.republish()`` has every
   rank publish its handshake again, and once READY the engine serves on (Health NOT_SERVING
   meanwhile; requests in flight keep running; KV handles of the old generation are refused
   by consumers). Counted in ``pdserve_engine_reregistrations_total``; a failed attempt
   (Redis still down) is counted and retried, INVALID or no READY within ``ready_timeout_s``
   is :class:`ReadinessFailed` (exit 1).
7. Clean stop: Health NOT_SERVING, new RPCs get UNAVAILABLE, ``backend.drain(drain_timeout_s)``
   (in-flight streams finish; a prefill engine waits out held KV), deregister, stop the server
   and the backend, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TextIO, TypeVar, runtime_checkable

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import Collector

from services.control_plane import (
    STOPPING_CALL_BOUND_S,
    ControlPlane,
    ControlPlaneError,
    ControlPlaneMetrics,
    RedisControlPlane,
)
from services.engines.backend import EngineBackend
from services.engines.errors import EngineFailed
from services.engines.producer_check import ProducerViews, producer_check_settings
from services.proto_gen.pdserve.v1 import engine_pb2
from services.serving.client.grpc_aio import server_options
from services.serving.errors import HostError, RegistrationLost
from services.serving.host.config import EngineServiceSettings, split_host_port
from services.serving.host.handlers import add_servicer
from services.serving.host.metrics import EngineServiceMetrics
from services.serving.host.registration import EngineRegistrar
from services.serving.host.role import RoleService
from services.serving.host.servicer import EngineServicer, ServingState
from services.serving.ready import ServingEndpoints

logger = logging.getLogger(__name__)


SERVER_STOP_GRACE_S = 5.0
T = TypeVar("T")
_ENGINE_SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]


@runtime_checkable
class ExportsMetrics(Protocol):
    """A backend whose ranks' metrics the service serves on its ``/metrics``."""

    def metrics_collector(self) -> Collector: ...


@runtime_checkable
class ReportsFailure(Protocol):
    """A backend that can say it failed (a rank died) while nobody is calling it; the host
    checks it on every heartbeat and stops serving."""

    @property
    def failure(self) -> EngineFailed | None: ...


class EngineHost:
    """Hosts one engine backend as a gRPC service (see the module docstring)."""

    def __init__(
        self,
        settings: EngineServiceSettings,
        backend: EngineBackend,
        *,
        engine_id: str,
        service: RoleService,
        registry: CollectorRegistry | None = None,
        ready_output: TextIO | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """``on_ready`` runs once the engine is READY, right before the ready line: the process
        entry point freezes its start-up heap there
        (:func:`services.lifetime.freeze_startup_heap`)."""
        self.settings = settings
        self.backend = backend
        self.engine_id = engine_id
        self.service = service
        self.role = service.role
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = EngineServiceMetrics(self.registry, engine_id, self.role.value)
        control_plane_metrics = ControlPlaneMetrics(self.registry)
        self._control_plane_metrics = control_plane_metrics
        self.control_plane: ControlPlane = RedisControlPlane(
            settings.control_plane, control_plane_metrics
        )
        # Producer checks read through their own client, with a short retry budget: during an
        # outage they answer from remembered views rather than wait (ProducerViews).
        self._producer_check_plane: ControlPlane = RedisControlPlane(
            producer_check_settings(settings.control_plane), control_plane_metrics
        )
        self.producer_views = ProducerViews(
            self._producer_check_plane,
            max_stale_s=settings.producer_view_max_stale,
            retry_after_s=settings.producer_view_retry_after_s,
            on_fallback=self.metrics.count_producer_check_fallback,
        )
        self._producer_follower: asyncio.Task[None] | None = None
        """Consumer engines: keeps the producer views' watcher (their cached view)."""
        self._ready_output = ready_output if ready_output is not None else sys.stdout
        self._on_ready = on_ready
        self._fatal: asyncio.Future[HostError | EngineFailed] | None = None
        self._server: grpc.aio.Server | None = None
        # grpc_health ships no stubs for its asyncio servicer (``health.aio``).
        self._health: Any = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._metrics_server: object | None = None
        self.endpoints: ServingEndpoints | None = None
        self.registrar = EngineRegistrar(
            engine_id=engine_id,
            settings=settings,
            control_plane=self.control_plane,
            backend=backend,
            metrics=self.metrics,
            control_plane_metrics=control_plane_metrics,
            failure=self._backend_failure,
            on_fatal=self._fail,
            set_health=self._set_health,
            on_reregistered=self._reregistered,
        )

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (exit code 0 after a clean drain) or a fatal error (1)."""
        self._fatal = asyncio.get_running_loop().create_future()
        description = self.backend.describe()
        state = ServingState(
            self.backend,
            description,
            self.metrics,
            engine_id=self.engine_id,
            on_engine_failed=self._fail,
        )
        if isinstance(self.backend, ExportsMetrics):
            self.metrics.collector(self.backend.metrics_collector())
        if self.role.consumes_kv:
            self._producer_follower = asyncio.create_task(
                self._follow_producers(), name="pdserve-producer-views"
            )
        heartbeat: asyncio.Task[None] | None = None
        registered = False
        try:
            port = await self._start_server(state)
            metrics_url = self._start_metrics()
            endpoint = self._advertised(port)
            spec = description.spec(self.engine_id, self.role, endpoint)
            generation = await self.registrar.register(spec)
            registered = True
            state.generation = generation
            logger.info("registered %s generation %s at %s", self.engine_id, generation, endpoint)
            heartbeat = asyncio.create_task(self.registrar.heartbeat(state))
            heartbeat.add_done_callback(self._heartbeat_ended)
            registration = self.registrar.registration(generation)
            if not (
                await self._until(stop, self.backend.start(registration))
                and await self._until(stop, self.registrar.backend_started(generation))
                and await self._until(stop, self.registrar.wait_ready(generation))
            ):
                logger.info("engine %s stopped before it was READY", self.engine_id)
                await self._abandon(state, heartbeat, deregister=True, stop_backend=True)
                return 0
            state.admitting = True
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            self.endpoints = ServingEndpoints(self.engine_id, generation, endpoint, metrics_url)
            if self._on_ready is not None:
                self._on_ready()
            print(self.endpoints.ready_line(), file=self._ready_output, flush=True)
            stop_wait: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
            try:
                serving: set[asyncio.Future[Any]] = {stop_wait, self._fatal}
                await asyncio.wait(serving, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_wait.cancel()
            if self._fatal.done():
                raise self._fatal.result()
            return await self._shutdown(state, heartbeat)
        except (HostError, EngineFailed) as exc:
            logger.error("engine %s stops serving: %s", self.engine_id, exc)
            print(f"pdserve {self.role.value}: {exc}", file=sys.stderr, flush=True)
            lost = isinstance(exc, RegistrationLost)
            await self._abandon(
                state,
                heartbeat,
                deregister=registered and not lost,
                # The backend starts right after the registration: stop it from then on.
                stop_backend=registered,
            )
            return 1
        finally:
            await self._close()

    def _backend_failure(self) -> EngineFailed | None:
        return self.backend.failure if isinstance(self.backend, ReportsFailure) else None

    def _reregistered(self, generation: int) -> None:
        if self.endpoints is not None:
            self.endpoints = dataclasses.replace(self.endpoints, generation=generation)

    def _heartbeat_ended(self, task: asyncio.Task[None]) -> None:
        """A heartbeat that dies of an unexpected error is fatal at once: silently, the lease
        would run out a few seconds later and the engine vanish under its host."""
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._fail(HostError(f"the heartbeat of {self.engine_id} died: {exc!r}"))

    def _fail(self, exc: HostError | EngineFailed) -> None:
        """Stop serving with ``exc`` (the first fatal error wins)."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_result(exc)

    async def _until(self, stop: asyncio.Event, work: Awaitable[T]) -> bool:
        """Run ``work`` unless ``stop`` or a fatal error comes first; ``True`` when it finished.

        A fatal error is raised; a stop cancels ``work`` and returns ``False``.
        """
        assert self._fatal is not None
        task = asyncio.ensure_future(work)
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({task, stop_wait, self._fatal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        if task.done():
            task.result()
            return True
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            logger.warning(
                "start-up work of %s failed as it was cancelled: %s", self.engine_id, exc
            )
        if self._fatal.done():
            raise self._fatal.result()
        return False

    async def _shutdown(self, state: ServingState, heartbeat: asyncio.Task[None] | None) -> int:
        """The clean stop: drain while still registered (consumers may still pull held KV),
        then deregister and stop."""
        logger.info(
            "engine %s draining (bound %.1fs)", self.engine_id, self.settings.drain_timeout_s
        )
        state.admitting = False
        state.draining = True
        await self._health.enter_graceful_shutdown()
        aborted = await self.backend.drain(self.settings.drain_timeout_s)
        if aborted:
            logger.warning(
                "drain aborted %d requests that did not finish in %.1fs",
                aborted,
                self.settings.drain_timeout_s,
            )
            self.metrics.count_drain_aborted(aborted)
        await self._abandon(state, heartbeat, deregister=True, stop_backend=True)
        assert self._fatal is not None
        if self._fatal.done():
            exc = self._fatal.result()
            logger.error("engine %s failed while draining: %s", self.engine_id, exc)
            print(f"pdserve {self.role.value}: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0

    async def _abandon(
        self,
        state: ServingState,
        heartbeat: asyncio.Task[None] | None,
        *,
        deregister: bool,
        stop_backend: bool,
    ) -> None:
        state.admitting = False
        await self._health.enter_graceful_shutdown()
        if heartbeat is not None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        if deregister:
            # The generation read after the heartbeat stopped: a re-registration may have
            # moved it on.
            try:
                await asyncio.wait_for(
                    self.control_plane.deregister(self.engine_id, state.generation),
                    STOPPING_CALL_BOUND_S,
                )
            except (ControlPlaneError, TimeoutError) as exc:
                # Its lease runs out instead: the router sees it gone a few seconds later.
                # (Failures after every retry: pdserve_control_plane_redis_errors_total.)
                logger.warning(
                    "deregistering %s failed (%s): leaving it to its lease",
                    self.engine_id,
                    str(exc) or f"no answer within {STOPPING_CALL_BOUND_S}s",
                )
        if self._server is not None:
            await self._server.stop(SERVER_STOP_GRACE_S)
        if stop_backend:
            try:
                await self.backend.stop()
            except Exception:
                logger.exception("stopping the backend of %s failed", self.engine_id)

    async def _follow_producers(self) -> None:
        """The producer views' watcher, on a plane of its own (its engine-state gauges stay out
        of this engine's metrics). Failing only costs the cached view: checks read Redis."""
        plane = RedisControlPlane(self.settings.control_plane, ControlPlaneMetrics())
        try:
            await self.producer_views.follow(plane)
        except Exception:
            logger.exception(
                "producer views of %s stopped following the control plane", self.engine_id
            )
        finally:
            await plane.close()

    async def _close(self) -> None:
        follower = self._producer_follower
        if follower is not None:
            self._producer_follower = None
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
        if self._server is not None:
            await self._server.stop(None)
            self._server = None
        server = self._metrics_server
        if server is not None:
            self._metrics_server = None
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
        await self.control_plane.close()
        await self._producer_check_plane.close()

    # -- pieces --------------------------------------------------------------------------

    async def _start_server(self, state: ServingState) -> int:
        grpc_settings = self.settings.grpc
        server = grpc.aio.server(options=server_options(grpc_settings.max_message_bytes))
        # pdserve's own services through add_servicer: undecodable requests are
        # INVALID_ARGUMENT, not grpc.aio's UNKNOWN (see services.serving.host.handlers).
        add_servicer(server, _ENGINE_SERVICE, EngineServicer(state), state)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        role_servicer = self.service.servicer(state, self.producer_views)
        add_servicer(server, self.service.descriptor, role_servicer, state)
        tls = grpc_settings.tls()
        try:
            if tls is None:
                port = server.add_insecure_port(grpc_settings.listen)
            else:
                port = server.add_secure_port(grpc_settings.listen, tls.credentials())
        except (RuntimeError, ValueError) as exc:
            raise HostError(f"cannot listen on {grpc_settings.listen}: {exc}") from exc
        if port == 0:
            raise HostError(f"cannot listen on {grpc_settings.listen} (address in use?)")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        return port

    def _start_metrics(self) -> str | None:
        port = self.settings.metrics_port
        if port is None:
            return None
        try:
            server, _thread = start_http_server(
                port, addr=self.settings.metrics_host, registry=self.registry
            )
        except OSError as exc:
            raise HostError(f"cannot serve metrics on port {port}: {exc}") from exc
        self._metrics_server = server
        host = self.settings.metrics_host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{server.server_port}/metrics"

    def _advertised(self, port: int) -> str:
        if self.settings.grpc.advertise is not None:
            return self.settings.grpc.advertise
        host, _ = split_host_port(self.settings.grpc.listen)
        if host in ("0.0.0.0", "[::]", "::", ""):
            host = socket.gethostname()
        return f"{host}:{port}"

    async def _set_health(
        self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType
    ) -> None:
        service_names = ["", _ENGINE_SERVICE.full_name, self.service.descriptor.full_name]
        for name in service_names:
            await self._health.set(name, status)
