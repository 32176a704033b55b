"""The engine loop: one host thread driving the scheduler and the rank processes.

The backend's coroutines never touch the scheduler or the pipes: they hand the loop a callable
(:meth:`EngineLoop.call`), which runs on the loop's thread between two steps, and receive results
through their request's sink. The loop, until stopped::

    run the queued calls (submit, abort, drain...)
    send the scheduler's outbox to every rank (hold, release, pull, cancel)
    plan a step; if there is one, send it to every rank and wait for the last stage's logits
    (handling other rank events as they come), then sample; else wait for a rank event, a call
    or 50 ms
    publish the prefix cache's KV events of this iteration as one batch (with a publisher)

A rank death (sentinel) or fatal error ends the loop: every in-flight request gets
:class:`EngineFailed`, the remaining ranks are killed, and every later call raises.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import Pipe
from typing import Any, TypeVar

from services.control_plane.errors import ControlPlaneError
from services.control_plane.wire import MAX_REPORTED_BLOCKS
from services.engines.backend import EngineRegistration
from services.engines.errors import EngineFailed
from services.engines.reference.executor import RankGroup
from services.engines.reference.messages import (
    LeaseEnded,
    MetricsSnapshot,
    PullDone,
    RankEvent,
    RankRepublished,
    Republish,
    Shutdown,
    StepLogits,
    StepPlan,
)
from services.engines.reference.metrics import RankMetricsRelay
from services.engines.reference.rank import DIST_TIMEOUT_S
from services.engines.reference.request_state import PlannedStep
from services.engines.reference.scheduler import Scheduler
from services.kv_events.publisher import KVEventPublisher
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.05
STEP_TIMEOUT_S = DIST_TIMEOUT_S + 30.0
"""A step whose logits have not come after this long fails the engine (a rank hangs)."""


@dataclass(frozen=True)
class LoadSnapshot:
    """What the loop last saw, readable from any thread."""

    queue_depth: int = 0
    running: int = 0
    in_flight: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    cached_blocks: tuple[int, ...] | None = None
    """The prefix cache's most recently used block keys (``None``: no prefix cache)."""


@dataclass
class _PendingRepublish:
    """A :meth:`EngineLoop.republish` waiting for every rank's answer."""

    generation: int
    done: concurrent.futures.Future[None]
    answers: dict[RankKey, str] = field(default_factory=dict)


class EngineLoop:
    """See the module docstring."""

    def __init__(
        self,
        group: RankGroup,
        scheduler: Scheduler,
        relay: RankMetricsRelay,
        *,
        stop_timeout_s: float,
        kv_events: KVEventPublisher | None = None,
    ) -> None:
        """With ``kv_events`` the scheduler must record its prefix cache's events
        (``record_kv_events``); the loop publishes them, never blocking on the publisher."""
        self.group = group
        self.scheduler = scheduler
        self._relay = relay
        self._stop_timeout_s = stop_timeout_s
        self._kv_events = kv_events
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._step_id = 0
        self.failure: EngineFailed | None = None
        self._republish: _PendingRepublish | None = None
        self.snapshot = LoadSnapshot(total_blocks=scheduler.limits.num_blocks)
        self._cache_version = -1
        self._cached_keys: tuple[int, ...] = ()
        self._thread = threading.Thread(
            target=self._run, name=f"pdserve-engine-{scheduler.engine_id}", daemon=True
        )

    def start(self) -> None:
        self._update_snapshot()
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the loop's thread between steps; its result or exception comes back
        through the future (:class:`EngineFailed` once the engine failed or stopped)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.failure is not None:
            future.set_exception(self.failure)
            return future
        if self._stop.is_set():
            future.set_exception(EngineFailed("the engine is stopped"))
            return future
        self._calls.put((fn, future))
        self._wake()
        if not self._thread.is_alive() and future.set_running_or_notify_cancel():
            # The loop ended between the checks above and the put: nobody will run it.
            future.set_exception(self.failure or EngineFailed("the engine is stopped"))
        return future

    def republish(self, registration: EngineRegistration) -> concurrent.futures.Future[None]:
        """Have every rank publish its handshake under ``registration.generation``; from now on
        the scheduler's KV handles carry that generation. The future resolves once every rank
        answered: ``ControlPlaneError`` naming the ranks that could not publish."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def begin() -> None:
            previous = self._republish
            if previous is not None and not previous.done.done():
                previous.done.set_exception(
                    ControlPlaneError("superseded by a newer republish", reason="superseded")
                )
            self._republish = _PendingRepublish(registration.generation, done)
            self.scheduler.generation = registration.generation
            self.group.broadcast(Republish(registration))

        started = self.call(begin)

        def on_started(future: concurrent.futures.Future[None]) -> None:
            error = future.exception()
            if error is not None and not done.done():
                done.set_exception(error)

        started.add_done_callback(on_started)
        return done

    def stop(self) -> None:
        """Ask the loop to stop the ranks and exit; :meth:`join` waits for it."""
        self._stop.set()
        self._wake()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _wake(self) -> None:
        with self._wake_lock, contextlib.suppress(OSError):
            self._wake_writer.send_bytes(b"w")

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_calls()
                self._flush_outbox()
                step = self.scheduler.schedule()
                self._flush_outbox()  # pulls started by admission
                if step is not None:
                    self._run_step(step)
                    self._flush_outbox()
                else:
                    for event in self.group.receive(IDLE_WAIT_S, extra=self._wake_reader):
                        self._dispatch(event)
                    while self._wake_reader.poll():
                        self._wake_reader.recv_bytes()
                self._publish_kv_events()
                self._update_snapshot()
                self.scheduler.deliver_all()
        except EngineFailed as exc:
            self._fail(exc)
        except Exception as exc:  # a bug in the loop: fail loudly rather than hang callers
            logger.exception("engine loop crashed")
            self._fail(EngineFailed(f"engine loop crashed: {exc!r}"))
        finally:
            self._shutdown()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except EngineFailed:
                raise
            except BaseException as exc:
                future.set_exception(exc)

    def _flush_outbox(self) -> None:
        outbox = self.scheduler.outbox
        while outbox:
            self.group.broadcast(outbox.pop(0))

    def _run_step(self, step: PlannedStep) -> None:
        self._step_id += 1
        step_id = self._step_id
        self.group.broadcast(StepPlan(step_id, step.chunks, step.all_tokens))
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while True:
            logits = None
            for event in self.group.receive(1.0):
                if isinstance(event, StepLogits) and event.step_id == step_id:
                    logits = event.logits
                else:
                    self._dispatch(event)
            if logits is not None:
                break
            if time.monotonic() > deadline:
                raise EngineFailed(f"step {step_id} produced no logits in {STEP_TIMEOUT_S} s")
        self.scheduler.complete_step(step, logits)

    def _dispatch(self, event: RankEvent) -> None:
        if isinstance(event, PullDone):
            self.scheduler.on_pull_done(event)
        elif isinstance(event, LeaseEnded):
            self.scheduler.on_lease_ended(event)
        elif isinstance(event, MetricsSnapshot):
            self._relay.update(event.rank, event.families)
        elif isinstance(event, RankRepublished):
            self._on_republished(event)

    def _on_republished(self, event: RankRepublished) -> None:
        pending = self._republish
        if pending is None or pending.generation != event.generation:
            return  # an answer to a superseded republish
        pending.answers[event.rank] = event.error
        if len(pending.answers) < len(self.group.ranks) or pending.done.done():
            return
        self._republish = None
        errors = {rank: error for rank, error in sorted(pending.answers.items()) if error}
        if errors:
            listed = "; ".join(f"rank {rank}: {error}" for rank, error in errors.items())
            pending.done.set_exception(
                ControlPlaneError(f"republish of generation {event.generation} failed: {listed}")
            )
        else:
            pending.done.set_result(None)

    def _publish_kv_events(self) -> None:
        cache = self.scheduler.blocks.prefix_cache
        if self._kv_events is None or cache is None:
            return
        events = cache.take_events()
        if events:
            self._kv_events.publish(events)

    def _update_snapshot(self) -> None:
        s = self.scheduler
        cache = s.blocks.prefix_cache
        cached: tuple[int, ...] | None = None
        if cache is not None:
            if cache.version != self._cache_version:  # rebuilt only when the cache changed
                self._cache_version = cache.version
                self._cached_keys = cache.recent_keys(MAX_REPORTED_BLOCKS)
            cached = self._cached_keys
        self.snapshot = LoadSnapshot(
            queue_depth=s.queue_depth,
            running=s.running_count,
            in_flight=s.in_flight,
            free_blocks=s.blocks.free_count(),
            total_blocks=s.limits.num_blocks,
            cached_blocks=cached,
        )

    def _fail(self, error: EngineFailed) -> None:
        self.failure = error
        if self._republish is not None and not self._republish.done.done():
            self._republish.done.set_exception(error)
        logger.error("engine %s failed: %s", self.scheduler.engine_id, error)
        self.scheduler.fail_all(error)
        self.scheduler.deliver_all()
        self.group.kill()

    def _shutdown(self) -> None:
        if self.failure is None:
            self.scheduler.fail_all(EngineFailed("the engine stopped"))
            self.scheduler.deliver_all()
        self.group.stop(Shutdown(), self._stop_timeout_s)
        pending_error = self.failure or EngineFailed("the engine stopped")
        if self._republish is not None and not self._republish.done.done():
            self._republish.done.set_exception(pending_error)
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(pending_error)
        self._update_snapshot()
