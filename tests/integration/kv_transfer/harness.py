"""Worker processes for the KV data-plane tests: real NIXL agents moving real bytes.

Each :class:`WorkerProcess` is a separate process (``spawn``) running :func:`_worker_main`: it
receives ``(command, kwargs)`` over a pipe, runs it on its :class:`_Worker` and answers
``("ok", value)`` or ``("err", traceback)``. A worker plays one ``(engine, pp, tp)`` rank at a
time (``setup`` replaces the previous one), so one pool of processes serves many layouts.
Handshake records travel between processes encoded (``wire.encode``), as through Redis.

KV content is a pattern of (request seed, global layer, K/V, global head, token, dim), so a
consumer checks byte for byte that it received exactly its layers and heads, and that no other
block of its pool was written.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from services.control_plane.aggregation import aggregate
from services.control_plane.wire import (
    EngineRecord,
    EngineRole,
    EngineState,
    compute_compat_hash,
    decode,
    encode,
    record_shape,
)
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.producer import KVProducer
from services.kv_transfer.protocol import WorkerIdentity
from services.topology import EngineLayout, ModelShape

BLOCK_SIZE = 4
HEAD_SIZE = 8
DTYPE = "float16"


@dataclass(frozen=True)
class EngineSpec:
    """An engine's layout and identity, picklable for worker processes."""

    engine_id: str
    generation: int
    num_layers: int
    num_kv_heads: int
    pp: int
    tp: int
    partition: tuple[int, ...] | None = None
    role: str = "prefill"
    block_size: int = BLOCK_SIZE
    head_size: int = HEAD_SIZE

    def layout(self) -> EngineLayout:
        return EngineLayout.uniform(
            self.num_layers, self.num_kv_heads, self.pp, self.tp, self.partition
        )

    def ranks(self) -> list[tuple[int, int]]:
        return [(p, t) for p in range(self.pp) for t in range(self.tp)]

    def shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=DTYPE,
            block_size=self.block_size,
            pp_size=self.pp,
            tp_size=self.tp,
        )


def compat_hash(spec: EngineSpec) -> str:
    return compute_compat_hash(spec.shape(), model="test-model", kv_layout="HND")


def engine_record_bytes(spec: EngineSpec) -> bytes:
    record = EngineRecord(
        engine_id=spec.engine_id,
        generation=spec.generation,
        role=EngineRole(spec.role),
        model="test-model",
        compat_hash=compat_hash(spec),
        shape=record_shape(spec.shape()),
        endpoint="localhost:0",
        pp_aware=True,
        lease_ttl_ms=10_000,
        registered_at_ms=0,
    )
    return encode(record)


def fill_pattern(pool: Any, block_ids: tuple[int, ...], seed: int) -> None:
    """Write the request pattern into ``block_ids`` of every local layer, K and V."""
    for index, layer in enumerate(pool.spec.layers):
        for kv, tensor in enumerate((pool.keys[index], pool.values[index])):
            tensor.view(torch.int16)[list(block_ids)] = expected_blocks(
                pool.spec, layer, kv, len(block_ids), seed
            )


def expected_blocks(pool_spec: Any, layer: int, kv: int, n_blocks: int, seed: int) -> Any:
    heads = torch.arange(pool_spec.kv_heads.start, pool_spec.kv_heads.stop, dtype=torch.int64)
    tokens = torch.arange(n_blocks * pool_spec.block_size, dtype=torch.int64).view(n_blocks, -1)
    dims = torch.arange(pool_spec.head_size, dtype=torch.int64)
    base = seed * 1_000_003 + layer * 7919 + kv * 104_729
    values = (
        base
        + heads[None, :, None, None] * 613
        + tokens[:, None, :, None] * 31
        + dims[None, None, None, :]
    ) % 65521 - 32768
    return values.to(torch.int16)


def check_blocks(pool: Any, block_ids: tuple[int, ...], seed: int) -> list[str]:
    """Differences between the pool and the pattern: request blocks exact, all others zero."""
    problems: list[str] = []
    others = [b for b in range(pool.spec.num_blocks) if b not in set(block_ids)]
    for index, layer in enumerate(pool.spec.layers):
        for kv, tensor in enumerate((pool.keys[index], pool.values[index])):
            raw = tensor.view(torch.int16)
            want = expected_blocks(pool.spec, layer, kv, len(block_ids), seed)
            got = raw[list(block_ids)]
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[:1].tolist()
                problems.append(f"layer {layer} {'KV'[kv]}: mismatch at {bad}")
            if others and bool(raw[others].any()):
                problems.append(
                    f"layer {layer} {'KV'[kv]}: a block outside the request was written"
                )
    return problems


@dataclass
class _Worker:
    """The state of one worker process (one rank at a time)."""

    pool: Any = None
    transport: Any = None
    producer: Any = None
    consumer: Any = None
    metrics: Any = None
    identity: Any = None

    def setup(
        self,
        engine: EngineSpec,
        rank: tuple[int, int],
        num_blocks: int = 32,
        lease_s: float = 10.0,
        policy: str = "fail",
    ) -> bytes:
        """Become ``rank`` of ``engine``; returns the encoded handshake record."""
        self.close()
        layout = engine.layout()
        shard = layout.shards[rank]
        self.pool = KVBlockPool(
            KVPoolSpec(
                shard.layers,
                shard.kv_heads,
                num_blocks,
                engine.block_size,
                engine.head_size,
                DTYPE,
            )
        )
        self.identity = WorkerIdentity(engine.engine_id, engine.generation, *rank)
        self.metrics = KVTransferMetrics(CollectorRegistry())
        self.transport = NixlTransport(self.pool, self.identity)
        self.producer = KVProducer(self.transport, metrics=self.metrics, default_lease_s=lease_s)
        self.consumer = KVConsumer(
            self.transport,
            layout,
            metrics=self.metrics,
            policy=policy,  # type: ignore[arg-type]
        )
        record = self.transport.handshake_record(
            worker_id=f"w{os.getpid()}-{engine.generation}", compat_hash=compat_hash(engine)
        )
        return encode(record)

    # -- producer ------------------------------------------------------------------------------

    def prefill(
        self,
        request_id: str,
        n_blocks: int,
        seed: int,
        lease_s: float | None = None,
        pattern: bool = True,
    ) -> tuple[int, ...]:
        """Allocate and fill a request's blocks, lease them, drop the engine's own reference.

        Without ``pattern`` the blocks are filled with ones (fast, for large requests).
        """
        blocks = self.pool.allocate(n_blocks)
        if pattern:
            fill_pattern(self.pool, blocks, seed)
        else:
            for tensor in (*self.pool.keys, *self.pool.values):
                tensor[list(blocks)] = 1
        self.producer.hold(request_id, blocks, lease_s=lease_s)
        self.pool.free(blocks)
        return tuple(blocks)

    def serve(self, request_ids: list[str], timeout_s: float = 20.0) -> dict[str, str]:
        """Poll until every request's lease ended; ``{request_id: outcome}`` (missing: held)."""
        ended: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not set(request_ids) <= set(ended):
            events = self.producer.poll()
            for end in (*events.released, *events.expired):
                ended[end.request_id] = end.outcome
            time.sleep(0.001)
        return ended

    # -- consumer ------------------------------------------------------------------------------

    def connect(self, engine: bytes, records: dict[str, bytes]) -> int:
        """Connect to a producer engine from its encoded records (aggregated as readers do)."""
        aggregation = aggregate(decode(engine, EngineRecord), records)
        if aggregation.state is not EngineState.READY or aggregation.topology is None:
            raise RuntimeError(f"producer not READY: {aggregation.problems}")
        self.consumer.connect(aggregation.topology)
        return len(records)

    def pull(
        self,
        request_id: str,
        producer_engine: str,
        generation: int,
        remote_ids: tuple[int, ...],
        seed: int,
        pull_timeout_s: float = 10.0,
        fence_with: tuple[bytes, dict[str, bytes]] | None = None,
        cancel: bool = False,
        kill_pid: int | None = None,
        keep_blocks: bool = False,
    ) -> dict[str, Any]:
        """Pull into freshly allocated blocks, wait for the outcome, check and free them.

        ``fence_with``: connect to this (new generation) topology right after starting the
        pull, before any poll; ``cancel``: cancel it there instead; ``kill_pid``: SIGKILL that
        process there (the producer dying while the read is in flight). Returns a summary.
        """
        local = self.pool.allocate(len(remote_ids))
        started = time.monotonic()
        try:
            self.consumer.pull(
                request_id,
                producer_engine=producer_engine,
                producer_generation=generation,
                remote_block_ids=remote_ids,
                local_block_ids=local,
                timeout_s=pull_timeout_s,
            )
            if fence_with is not None:
                self.connect(*fence_with)
            if cancel:
                assert self.consumer.cancel(request_id, producer_engine)
            if kill_pid is not None:
                assert self.consumer.pending() == 1, "the read should still be in flight"
                os.kill(kill_pid, signal.SIGKILL)
            outcomes: list[Any] = []
            while not outcomes:
                outcomes = self.consumer.poll()
            outcome = outcomes[0]
            elapsed = time.monotonic() - started
            problems = check_blocks(self.pool, local, seed) if outcome.ok else []
            return {
                "ok": outcome.ok,
                "action": outcome.action,
                "reasons": sorted({f.reason for f in outcome.result.failures}),
                "failed_blocks": list(outcome.failed_block_ids),
                "local_blocks": list(local),
                "bytes": outcome.result.nbytes,
                "seconds": elapsed,
                "problems": problems,
                "unnotified": list(outcome.result.unnotified),
            }
        finally:
            if not keep_blocks:
                self.release_blocks(local)

    def release_blocks(self, blocks: tuple[int, ...]) -> None:
        """Zero and free local blocks (the next request's check wants untouched blocks zero)."""
        for tensor in (*self.pool.keys, *self.pool.values):
            tensor[list(blocks)] = 0
        self.pool.free(blocks)

    def start_pull_and_hang(
        self,
        request_id: str,
        producer_engine: str,
        generation: int,
        remote_ids: tuple[int, ...],
        progress_s: float = 0.0,
    ) -> int:
        """Start a pull, progress it for ``progress_s``, then stop polling (the test kills
        this process). Returns the pulls still pending."""
        local = self.pool.allocate(len(remote_ids))
        self.consumer.pull(
            request_id,
            producer_engine=producer_engine,
            producer_generation=generation,
            remote_block_ids=remote_ids,
            local_block_ids=local,
            timeout_s=60.0,
        )
        deadline = time.monotonic() + progress_s
        finished: list[Any] = []
        while time.monotonic() < deadline and not finished:
            finished = self.consumer.poll()
        return int(self.consumer.pending())

    def progress_step(self) -> None:
        """One poll of the consumer side, as a rank's loop does every few milliseconds: the
        NIXL agent progresses, so notifications queued in UCX (e.g. "notify only" messages to
        replicas nobody read) reach their producers."""
        if self.consumer is not None:
            self.consumer.poll()

    def noop(self) -> None:
        """Answers nothing: ends a ``progress`` command (see :meth:`WorkerProcess.progress`)."""

    # -- both ----------------------------------------------------------------------------------

    def pool_status(self) -> tuple[int, int]:
        return self.pool.free_count, self.pool.num_blocks

    def metric(self, name: str, labels: dict[str, str]) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)

    def close(self) -> tuple[int, int] | None:
        """Close the transport; return (free, total) blocks of the pool (None when none)."""
        status = None
        if self.transport is not None:
            status = self.pool_status()
            self.transport.close()
        self.pool = self.transport = self.producer = self.consumer = None
        return status


def _worker_main(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers end
    worker = _Worker()
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            return
        if command == "exit":
            worker.close()
            conn.send(("ok", None))
            return
        if command == "progress":  # poll until the parent's next command arrives
            while not conn.poll(0.001):
                worker.progress_step()
            conn.send(("ok", None))
            continue
        try:
            conn.send(("ok", getattr(worker, command)(**kwargs)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class WorkerError(RuntimeError):
    """A command failed inside a worker process (the message is its traceback)."""


class WorkerProcess:
    """A spawned worker and the parent end of its pipe."""

    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.outstanding = 0
        self.progressing = False

    def drain(self, timeout_s: float = 30.0) -> None:
        """Collect answers a failed test left unread, so the next command pairs up."""
        if self.progressing:
            self.settle()
        while self.outstanding > 0:
            with contextlib.suppress(WorkerError):
                self.recv(timeout_s)

    def send(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))
        self.outstanding += 1

    def recv(self, timeout_s: float = 60.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.process.pid} did not answer in {timeout_s} s")
        status, value = self.conn.recv()
        self.outstanding -= 1
        if status != "ok":
            raise WorkerError(value)
        return value

    def call(self, command: str, timeout_s: float = 60.0, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.recv(timeout_s)

    def progress(self) -> None:
        """Keep this worker's consumer progressing (as real ranks do) until :meth:`settle`."""
        self.send("progress")
        self.progressing = True

    def settle(self) -> None:
        """End :meth:`progress`: any command stops it; ``noop`` then answers too."""
        self.progressing = False
        self.send("noop")
        self.recv()
        self.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError, WorkerError):
                self.call("exit", timeout_s=20)
            self.process.join(10)
        self.kill()


def spawn_workers(count: int) -> list[WorkerProcess]:
    ctx = multiprocessing.get_context("spawn")
    return [WorkerProcess(ctx) for _ in range(count)]


def rank_field(rank: tuple[int, int]) -> str:
    return f"{rank[0]}:{rank[1]}"


__all__ = ["EngineSpec", "WorkerError", "WorkerProcess", "spawn_workers"]
