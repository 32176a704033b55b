"""One ``(pp_rank, tp_rank)`` of a reference engine, in its own process.

:func:`rank_main` is the rank process's entry point (forked or spawned by the host). The rank joins
the engine's gloo process group (PP activations go point to point between stages, the TP all-reduce
runs in a sub-group per stage), loads only its shard, keeps its layers' and heads' KV in a
:class:`KVBlockPool` registered with its own NIXL agent, publishes its handshake record for
``(engine id, generation, pp_rank, tp_rank)`` and then serves the host's commands
(:mod:`~services.engines.reference.messages`) in the order they come. After the control plane lost
the registration, :class:`Republish` publishes the same record (same agent, same memory) under the
new generation.

The pool's own allocator is not used to hand out blocks: the host's scheduler owns block
allocation for the whole engine (ids are the same on every rank), so at start the rank takes one
reference on every block for the engine. A producer lease adds a reference (and drops it when it
ends); a pull needs its local blocks allocated, which they always are.

The loop is asyncio so the rank can follow the control plane (PeerSync pre-warms producers that
turn READY) while it serves: it wakes on a host command or every ``POLL_INTERVAL_S`` to poll the
NIXL transport, which must happen every few milliseconds while it moves KV (NIXL's progress
thread is off: a READ of this rank's blocks, or a notification either side sends, advances
only when its agent is polled). A rank with nothing in flight (no pull, no lease held) and no
data-plane work for ``ACTIVE_GRACE_S`` polls every ``IDLE_POLL_INTERVAL_S`` instead: an idle
rank polling every 5 ms used 2.7% of a core. A forward step runs synchronously on the loop; it
is short.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from services.control_plane import (
    STOPPING_CALL_BOUND_S,
    ControlPlaneError,
    ControlPlaneMetrics,
    EngineNotFound,
    RedisControlPlane,
)
from services.control_plane.wire import EngineRecord
from services.engines.backend import EngineRegistration
from services.engines.errors import EngineFailed
from services.engines.reference.batch import ForwardBatch, PagedKVCache
from services.engines.reference.config import ModelConfig
from services.engines.reference.layers import AllReduce
from services.engines.reference.loader import load_model
from services.engines.reference.messages import (
    CancelPull,
    HoldKV,
    HostCommand,
    LeaseEnded,
    MetricsSnapshot,
    PullDone,
    PullKV,
    RankEvent,
    RankFatal,
    RankReady,
    RankRepublished,
    ReleaseKV,
    Republish,
    Shutdown,
    StepLogits,
    StepPlan,
)
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.sharding import ShardSpec
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer, PullOutcome
from services.kv_transfer.errors import KVTransferError, LeaseError
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.peer_sync import PeerSync
from services.kv_transfer.producer import KVProducer
from services.kv_transfer.protocol import WorkerIdentity, rank_label
from services.lifetime import exit_with_parent
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005
"""Longest the rank goes without polling its NIXL transport while it moves KV."""
BUSY_POLL_INTERVAL_S = 0.0002
"""The same while one of its pulls is in flight."""
IDLE_POLL_INTERVAL_S = 0.05
"""The same with nothing in flight for ``ACTIVE_GRACE_S``: a peer's first contact (a
handshake's pre-warm) waits at most this long for this rank's agent to progress."""
ACTIVE_GRACE_S = 2.0
"""How long after its last data-plane work (a command, a lease, a pull, a notification) a
rank keeps polling every ``POLL_INTERVAL_S``: a consumer's completion notification goes out
only as its agent is polled."""
DIST_TIMEOUT_S = 120.0
"""gloo collectives and point-to-point ops give up after this (a peer rank died)."""


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs (pickled to a spawned process)."""

    options: ReferenceEngineOptions
    rank: RankKey
    registration: EngineRegistration
    init_method: str
    """``tcp://127.0.0.1:PORT`` of the gloo rendezvous (rank 0 listens)."""
    compat_hash: str


def global_rank(rank: RankKey, tp_size: int) -> int:
    return rank[0] * tp_size + rank[1]


RANK_GRACE_S = 5.0
"""From the host's death to SIGKILL of a rank that is still there (SIGTERM ends it first)."""


def rank_main(setup: RankSetup, conn: Connection) -> None:
    """Entry point of a rank process; returns when told to shut down or the host goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when ranks end
    torch.set_num_threads(1)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s rank {rank_label(setup.rank)} %(message)s"
    )
    # A host killed outright (SIGKILL, the OOM killer) takes its ranks with it, loading or not.
    exit_with_parent(RANK_GRACE_S, name=f"rank {rank_label(setup.rank)}")
    try:
        worker = RankWorker(setup, conn)
        asyncio.run(worker.run())
    except BaseException:
        with contextlib.suppress(OSError, ValueError):
            conn.send(RankFatal(setup.rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class RankWorker:
    """The state of one rank process (see the module docstring)."""

    def __init__(self, setup: RankSetup, conn: Connection) -> None:
        self.setup = setup
        self.conn = conn
        options = setup.options
        self.rank = setup.rank
        self.identity = WorkerIdentity(
            setup.registration.engine_id, setup.registration.generation, *setup.rank
        )
        self.layout = options.validate(ModelConfig.from_directory(options.model_dir))
        tp_size = options.tp_size
        self._global_rank = global_rank(self.rank, tp_size)
        all_reduce = self._init_distributed()
        dtype = getattr(torch, options.dtype)
        spec = ShardSpec.from_layout(self.layout, *self.rank)
        self.model = load_model(options.model_dir, spec, all_reduce=all_reduce, dtype=dtype)
        geometry = self.model.geometry
        config = self.model.config
        self.pool = KVBlockPool(
            KVPoolSpec(
                layers=geometry.layers,
                kv_heads=geometry.kv_heads,
                num_blocks=options.num_kv_blocks,
                block_size=options.block_size,
                head_size=config.head_dim,
                dtype=options.dtype,
            )
        )
        self.pool.allocate(options.num_kv_blocks)  # the engine's reference on every block
        self.cache = PagedKVCache(self.pool.keys, self.pool.values)
        self.metrics = KVTransferMetrics(CollectorRegistry())
        self.transport = NixlTransport(self.pool, self.identity, config=options.nixl)
        self.producer = KVProducer(
            self.transport, metrics=self.metrics, default_lease_s=options.kv_lease_s
        )
        self.consumer = KVConsumer(
            self.transport,
            self.layout,
            metrics=self.metrics,
            policy="fail",
            default_timeout_s=options.kv_pull_timeout_s,
        )
        self.worker_id = f"{self.transport.agent_name}-{os.getpid()}"
        self._waiting_pulls: dict[str, tuple[PullKV, float]] = {}
        self._next_metrics = 0.0
        self._stopping = False
        self._active_at = time.monotonic()
        """The last data-plane work (:meth:`_poll_interval`)."""
        self._control_plane: RedisControlPlane | None = None
        self._record: EngineRecord | None = None
        """The registration this rank's handshake is published under (withdrawn at exit)."""
        self._republishing: set[asyncio.Task[None]] = set()

    # -- set-up --------------------------------------------------------------------------------

    def _init_distributed(self) -> AllReduce | None:
        options = self.setup.options
        if options.world_size == 1:
            return None
        dist.init_process_group(
            "gloo",
            init_method=self.setup.init_method,
            rank=self._global_rank,
            world_size=options.world_size,
            timeout=timedelta(seconds=DIST_TIMEOUT_S),
        )
        if options.tp_size == 1:
            return None
        tp_size = options.tp_size
        # Every rank creates every stage's group, in the same order (a gloo requirement).
        groups = [
            dist.new_group([global_rank((pp, tp), tp_size) for tp in range(tp_size)])
            for pp in range(options.pp_size)
        ]
        group = groups[self.rank[0]]

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(tensor, group=group)
            return tensor

        return all_reduce

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        registration = self.setup.registration
        control_plane = RedisControlPlane(
            registration.control_plane, ControlPlaneMetrics(CollectorRegistry())
        )
        self._control_plane = control_plane
        follow: asyncio.Task[None] | None = None
        try:
            self._record = await self._publish(control_plane, registration)
            self._send(RankReady(self.rank, os.getpid(), self.transport.agent_name, self.worker_id))
            if registration.role.consumes_kv:
                follow = asyncio.create_task(self._follow(control_plane), name="peer-sync")
            await self._serve()
        finally:
            if follow is not None:
                follow.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await follow
            for task in self._republishing:
                task.cancel()
            self._send_metrics()
            if self._record is not None:
                # Never waits on Redis: the engine's record (and this handshake) expires with
                # its lease otherwise.
                with contextlib.suppress(ControlPlaneError, TimeoutError):
                    await asyncio.wait_for(
                        control_plane.withdraw_handshake(self._record, *self.rank, self.worker_id),
                        STOPPING_CALL_BOUND_S,
                    )
            await control_plane.close()
            self.transport.close()

    async def _publish(
        self,
        control_plane: RedisControlPlane,
        registration: EngineRegistration,
        *,
        missing: type[Exception] = EngineFailed,
    ) -> EngineRecord:
        """Publish this rank's handshake under ``registration``; ``missing`` when that
        generation is not the registered one."""
        view = await control_plane.get_engine(registration.engine_id)
        if view is None or view.record is None or view.generation != registration.generation:
            found = None if view is None else view.generation
            raise missing(
                f"engine {registration.engine_id} generation {registration.generation} is not "
                f"registered (found {found}: lease expired or replaced); cannot publish the "
                "handshake"
            )
        record = self.transport.handshake_record(
            worker_id=self.worker_id, compat_hash=self.setup.compat_hash
        )
        # The transport's identity keeps the generation it started under (it only names the
        # agent and tags notifications, which producers do not check); the record names the
        # registration it is published for.
        record = dataclasses.replace(record, generation=registration.generation)
        await control_plane.publish_handshakes(view.record, [record])
        return view.record

    async def _republish(self, command: Republish) -> None:
        generation = command.registration.generation
        assert self._control_plane is not None
        try:
            self._record = await self._publish(
                self._control_plane, command.registration, missing=EngineNotFound
            )
        except Exception as exc:  # reported to the host, which retries or gives up
            self._send(RankRepublished(self.rank, generation, f"{type(exc).__name__}: {exc}"))
            return
        self.identity = dataclasses.replace(self.identity, generation=generation)
        self._send(RankRepublished(self.rank, generation))

    async def _follow(self, control_plane: RedisControlPlane) -> None:
        sync = PeerSync(
            self.consumer,
            control_plane,
            compat_hash=self.setup.compat_hash,
            own_engine_id=self.identity.engine_id,
            metrics=self.metrics,
        )
        while True:
            try:
                async with control_plane.watch() as watcher:
                    await sync.follow(watcher)
            except ControlPlaneError as exc:
                logger.warning("control-plane watch failed (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        loop.add_reader(self.conn.fileno(), wake.set)
        try:
            while not self._stopping:
                wake.clear()
                while not self._stopping and self.conn.poll():
                    try:
                        command: HostCommand = self.conn.recv()
                    except EOFError:
                        return  # the host is gone
                    self._handle(command)
                    self._active_at = time.monotonic()
                if self._poll_data_plane():
                    self._active_at = time.monotonic()
                if self._stop_requested():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self._poll_interval())
        finally:
            loop.remove_reader(self.conn.fileno())

    def _stop_requested(self) -> bool:
        """``self._stopping``, read through a call: :meth:`_handle` sets it, which mypy cannot
        see after the loop's ``while not self._stopping`` (it would call the check unreachable)."""
        return self._stopping

    def _handle(self, command: HostCommand) -> None:
        if isinstance(command, StepPlan):
            self._step(command)
        elif isinstance(command, HoldKV):
            self.producer.hold(command.request_id, command.block_ids, lease_s=command.lease_s)
        elif isinstance(command, ReleaseKV):
            try:
                self.producer.abort(command.request_id)
            except LeaseError:
                return  # it already ended (released or expired) and was reported
            self._send(LeaseEnded(self.rank, command.request_id, "aborted"))
        elif isinstance(command, PullKV):
            self._start_pull(command)
        elif isinstance(command, CancelPull):
            self._cancel_pull(command)
        elif isinstance(command, Republish):
            task = asyncio.create_task(self._republish(command), name="republish")
            self._republishing.add(task)
            task.add_done_callback(self._republishing.discard)
        elif isinstance(command, Shutdown):
            self._stopping = True

    # -- forward -------------------------------------------------------------------------------

    def _step(self, plan: StepPlan) -> None:
        options = self.setup.options
        batch = ForwardBatch.build(plan.chunks, options.block_size)
        pp, tp = self.rank
        geometry = self.model.geometry
        if geometry.is_first_stage:
            hidden = self.model(batch, self.cache)
        else:
            incoming = torch.empty(
                batch.num_tokens, self.model.config.hidden_size, dtype=self.model.dtype
            )
            dist.recv(incoming, src=global_rank((pp - 1, tp), options.tp_size))
            hidden = self.model(batch, self.cache, incoming)
        if not geometry.is_last_stage:
            dist.send(hidden.contiguous(), dst=global_rank((pp + 1, tp), options.tp_size))
        elif tp == 0:
            indices = None if plan.all_tokens else batch.last_token_indices
            logits = self.model.compute_logits(hidden, indices)
            self._send(StepLogits(plan.step_id, logits.to(torch.float32)))

    # -- KV data plane -------------------------------------------------------------------------

    def _start_pull(self, command: PullKV) -> None:
        if not self._try_issue(command):
            self._waiting_pulls[command.request_id] = (
                command,
                time.monotonic() + command.connect_wait_s,
            )

    def _try_issue(self, command: PullKV) -> bool:
        """Issue the pull once this rank is connected to the producer at the command's
        generation, or fail it as ``stale_generation`` once connected at a later one; ``False``
        (nothing done) while neither is the case."""
        connected = self.consumer.connected(command.producer_engine)
        if connected == command.producer_generation:
            self._issue_pull(command)
            return True
        if connected is not None and connected > command.producer_generation:
            self._pull_failed(command.request_id, "stale_generation", "producer restarted")
            return True
        return False

    def _issue_pull(self, command: PullKV) -> None:
        try:
            self.consumer.pull(
                command.request_id,
                producer_engine=command.producer_engine,
                producer_generation=command.producer_generation,
                remote_block_ids=command.remote_block_ids,
                local_block_ids=command.local_block_ids,
                timeout_s=command.timeout_s,
            )
        except KVTransferError as exc:
            self._pull_failed(command.request_id, exc.reason, str(exc))

    def _cancel_pull(self, command: CancelPull) -> None:
        if self._waiting_pulls.pop(command.request_id, None) is not None:
            self._pull_failed(command.request_id, "cancelled", "cancelled before it started")
            return
        self.consumer.cancel(command.request_id, command.producer_engine)

    def _pull_failed(self, request_id: str, reason: str, message: str) -> None:
        self._send(PullDone(self.rank, request_id, False, reason, message))

    def _poll_interval(self) -> float:
        """A pull in flight is polled closely (its completion is on the TTFT path); KV held
        for consumers, or recent work, every few milliseconds; otherwise seldom."""
        if self.consumer.pending() > 0 or self._waiting_pulls:
            return BUSY_POLL_INTERVAL_S
        if self.producer.leases.held_blocks or time.monotonic() - self._active_at < ACTIVE_GRACE_S:
            return POLL_INTERVAL_S
        return IDLE_POLL_INTERVAL_S

    def _poll_data_plane(self) -> bool:
        """Poll both sides of the transport; whether anything happened."""
        events = self.producer.poll()
        for end in (*events.released, *events.expired):
            self._send(LeaseEnded(self.rank, end.request_id, end.outcome))
        outcomes = self.consumer.poll()
        for outcome in outcomes:
            self._send(self._pull_done(outcome))
        if self._waiting_pulls:
            now = time.monotonic()
            for request_id, (command, deadline) in list(self._waiting_pulls.items()):
                if self._try_issue(command):
                    del self._waiting_pulls[request_id]
                elif now >= deadline:
                    del self._waiting_pulls[request_id]
                    self._pull_failed(
                        request_id,
                        "producer_unavailable",
                        f"not connected to {command.producer_engine} generation "
                        f"{command.producer_generation} after {command.connect_wait_s} s",
                    )
        if time.monotonic() >= self._next_metrics:
            self._send_metrics()
        return bool(events.released or events.expired or events.rejected_notifications or outcomes)

    def _pull_done(self, outcome: PullOutcome) -> PullDone:
        result = outcome.result
        if outcome.ok:
            return PullDone(self.rank, result.request_id, True, nbytes=result.nbytes)
        failure = result.failures[0]
        return PullDone(
            self.rank, result.request_id, False, failure.reason, failure.message, result.nbytes
        )

    def _send_metrics(self) -> None:
        self._next_metrics = time.monotonic() + self.setup.options.metrics_interval_s
        self._send(MetricsSnapshot(self.rank, tuple(self.metrics.registry.collect())))

    def _send(self, event: RankEvent) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(event)
