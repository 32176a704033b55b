"""``pdserve bench kv``: pull a request's KV across processes over NIXL, next to memcpy.

A producer worker runs in a separate (spawned) process with a block pool of realistic geometry
(16-token blocks, 8 KV heads x 128 dims, 16-bit, several layers) filled with random bytes; this
process is the consumer. Both use the real data-plane stack (``KVBlockPool``, ``NixlTransport``,
``KVProducer`` / ``KVConsumer``, notifications and leases included). For each request size the
benchmark pulls the request ``--reps`` times, with the request's blocks contiguous and scattered
(random block ids on both sides: no descriptor merging), and reports:

- ``gbps``: request bytes over the wall time from ``pull()`` to its outcome (median);
- ``memcpy_gbps``: a torch copy of the same number of bytes in this process, in the same run
  (median; default torch threads), and ``memcpy_1thread_gbps`` with one thread; a NIXL read over
  UCX ``cma`` is one ``process_vm_readv`` stream, so the one-thread figure is its natural peer;
- ``ratio``: ``gbps / memcpy_gbps``;
- ``prep_us_per_request``: the per-request descriptor cost in steady state (validation, index
  arithmetic and ``make_prepped_xfer``, block tables given as arrays), also per 1,000 blocks and
  per 1,000 descriptors; ``prep_us_in_pull`` is the same work as timed inside the real pulls,
  where process wake-ups and cold caches around each request add to it;
- ``peer_prepare``: the one-time cost of pre-warming the peer (agent added, descriptor lists of
  every block prepared), paid when the producer turns READY, not per request.

Sampled blocks of every pull are checksummed on both sides (``verified``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

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
from services.kv_transfer.allocator import block_array
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.nixl_agent import NixlConfig
from services.kv_transfer.nixl_transport import NixlTransport
from services.kv_transfer.producer import KVProducer
from services.kv_transfer.protocol import WorkerIdentity
from services.topology import EngineLayout, ModelShape, Range

PRODUCER_ENGINE = "bench-prefill"
CONSUMER_ENGINE = "bench-decode"
_ANSWER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _Geometry:
    layers: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    num_blocks: int
    num_workers: int
    num_threads: int

    def nixl_config(self) -> NixlConfig:
        return NixlConfig(num_workers=self.num_workers, num_threads=self.num_threads)

    def pool_spec(self) -> KVPoolSpec:
        return KVPoolSpec(
            Range(0, self.layers),
            Range(0, self.kv_heads),
            self.num_blocks,
            self.block_size,
            self.head_size,
            self.dtype,
        )

    def engine_record(self, engine_id: str, role: EngineRole) -> EngineRecord:
        return EngineRecord(
            engine_id=engine_id,
            generation=1,
            role=role,
            model="bench",
            compat_hash=self.compat_hash(),
            shape=record_shape(self.shape()),
            endpoint="localhost:0",
            pp_aware=True,
            lease_ttl_ms=60_000,
            registered_at_ms=0,
        )

    def shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.layers,
            num_kv_heads=self.kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
        )

    def compat_hash(self) -> str:
        return compute_compat_hash(self.shape(), model="bench", kv_layout="HND")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens",
        default="1024,4096,16384,32768",
        help="request sizes in tokens (comma-separated)",
    )
    parser.add_argument("--layers", type=int, default=4, help="model layers (all on one worker)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-size", type=int, default=128, help="head dimension")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="KV dtype (16-bit)"
    )
    parser.add_argument("--reps", type=int, default=5, help="pulls per size and block layout")
    parser.add_argument(
        "--ucx-workers", type=int, default=1, help="UCX workers of each NIXL agent (num_workers)"
    )
    parser.add_argument(
        "--ucx-threads", type=int, default=0, help="UCX backend threads (num_threads; 0: default)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one small size, two layers, two reps (for tests)"
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    tokens = [int(t) for t in str(args.tokens).split(",") if t.strip()]
    layers, reps = int(args.layers), int(args.reps)
    if args.quick:
        tokens, layers, reps = [256], 2, 2
    block_size = int(args.block_size)
    blocks_needed = [-(-t // block_size) for t in tokens]
    geometry = _Geometry(
        layers=layers,
        kv_heads=int(args.kv_heads),
        head_size=int(args.head_size),
        block_size=block_size,
        dtype=str(args.dtype),
        num_blocks=max(blocks_needed) + 1,
        num_workers=int(args.ucx_workers),
        num_threads=int(args.ucx_threads),
    )
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_producer_main, args=(child, geometry), daemon=True)
    process.start()
    child.close()
    try:
        record, engine = _answer(parent)
        bench = _ConsumerBench(geometry, parent)
        peer_prepare = bench.connect(engine, record)
        first_pull_s = bench.pull(1, scattered=False)["seconds"]
        results = [
            bench.measure(n_tokens, n_blocks, scattered, reps)
            for n_tokens, n_blocks in zip(tokens, blocks_needed, strict=True)
            for scattered in (False, True)
        ]
        parent.send(("stop", None))
        producer_free, producer_total = _answer(parent)
        consumer_pool = bench.close()
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    spec = geometry.pool_spec()
    return {
        "benchmark": "kv",
        "geometry": {
            "layers": geometry.layers,
            "kv_heads": geometry.kv_heads,
            "head_size": geometry.head_size,
            "block_size": geometry.block_size,
            "dtype": geometry.dtype,
            "block_bytes": spec.block_len,
            "kv_bytes_per_token": 2 * geometry.layers * spec.block_len // geometry.block_size,
        },
        "environment": {
            "nixl": importlib.metadata.version("nixl"),
            "backend": "UCX",
            "progress_thread": False,
            "ucx_workers": geometry.num_workers,
            "ucx_threads": geometry.num_threads,
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "peer_prepare": peer_prepare,
        "first_pull_seconds": first_pull_s,
        "results": results,
        "pools_back_to_full": producer_free == producer_total and consumer_pool,
        "goal": {"ratio_at_64kib_blocks": 0.8, "prep_us_per_1000_blocks": 100.0},
    }


def _answer(conn: Connection) -> Any:
    try:
        if not conn.poll(_ANSWER_TIMEOUT_S):
            raise RuntimeError("the benchmark's producer process did not answer")
        status, value = conn.recv()
    except EOFError as exc:
        raise RuntimeError("the benchmark's producer process died") from exc
    if status != "ok":
        raise RuntimeError(f"the benchmark's producer process failed:\n{value}")
    return value


def _checksum(pool: KVBlockPool, block_ids: list[int]) -> int:
    """A cheap fingerprint of some blocks across every layer, K and V."""
    picked = pool.buffer[:, :, block_ids].contiguous().view(torch.int16).to(torch.int64)
    weights = torch.arange(1, picked.shape[-1] + 1, dtype=torch.int64)
    return int((picked * weights).sum())


def _sample(block_ids: tuple[int, ...]) -> list[int]:
    step = max(1, len(block_ids) // 8)
    return list(block_ids[::step])


class _ConsumerBench:
    def __init__(self, geometry: _Geometry, conn: Connection) -> None:
        self.geometry = geometry
        self.conn = conn
        self.pool = KVBlockPool(geometry.pool_spec())
        self.transport = NixlTransport(
            self.pool,
            WorkerIdentity(CONSUMER_ENGINE, 1, 0, 0),
            config=geometry.nixl_config(),
        )
        layout = EngineLayout.uniform(geometry.layers, geometry.kv_heads, 1, 1)
        self.consumer = KVConsumer(self.transport, layout, default_timeout_s=60.0)
        self.counter = 0

    def connect(self, engine: bytes, record: bytes) -> dict[str, float]:
        aggregation = aggregate(decode(engine, EngineRecord), {"0:0": record})
        if aggregation.state is not EngineState.READY or aggregation.topology is None:
            raise RuntimeError(f"benchmark producer not READY: {aggregation.problems}")
        started = time.perf_counter()
        self.consumer.connect(aggregation.topology)
        seconds = time.perf_counter() - started
        descriptors = 2 * 2 * self.geometry.layers * self.geometry.num_blocks  # local + remote
        return {
            "seconds": seconds,
            "descriptors": descriptors,
            "us_per_1000_descriptors": seconds * 1e6 / (descriptors / 1000),
        }

    def pull(
        self, n_blocks: int, *, scattered: bool, verify: bool = False, measure_prep: bool = False
    ) -> dict[str, Any]:
        self.counter += 1
        request_id = f"bench-{self.counter}"
        self.conn.send(("prefill", (request_id, n_blocks, scattered, verify)))
        remote, remote_sum = _answer(self.conn)
        local = self.pool.allocate(n_blocks)
        if scattered:
            local = tuple(local[i] for i in torch.randperm(n_blocks).tolist())
        # Block tables as arrays, as an engine keeps them (tuples cost ~20 ns per id and side).
        local_array, remote_array = block_array(local), block_array(remote)
        try:
            started = time.perf_counter()
            self.consumer.pull(
                request_id,
                producer_engine=PRODUCER_ENGINE,
                producer_generation=1,
                remote_block_ids=remote_array,
                local_block_ids=local_array,
            )
            outcomes = self.consumer.poll()
            while not outcomes:
                outcomes = self.consumer.poll()
            seconds = time.perf_counter() - started
            (outcome,) = outcomes
            if not outcome.ok:
                raise RuntimeError(f"benchmark pull failed: {outcome.result.failures}")
            verified = None
            if verify:
                verified = _checksum(self.pool, _sample(local)) == remote_sum
            steady_prep = None
            if measure_prep:
                spec = self.consumer.spec(
                    "prep-probe",
                    producer_engine=PRODUCER_ENGINE,
                    producer_generation=1,
                    remote_block_ids=remote_array,
                    local_block_ids=local_array,
                )
                steady_prep = self.transport.descriptor_cost(spec)
            stats = outcome.result.transfers
            return {
                "seconds": seconds,
                "bytes": outcome.result.nbytes,
                "descriptors": sum(s.descriptors for s in stats),
                "prep_seconds": outcome.result.setup_seconds + sum(s.prep_seconds for s in stats),
                "steady_prep_seconds": steady_prep,
                "verified": verified,
            }
        finally:
            self.pool.free(local)

    def measure(self, n_tokens: int, n_blocks: int, scattered: bool, reps: int) -> dict[str, Any]:
        pulls = [
            self.pull(n_blocks, scattered=scattered, verify=i == 0, measure_prep=i == 0)
            for i in range(reps)
        ]
        nbytes = pulls[0]["bytes"]
        gbps = [p["bytes"] / p["seconds"] / 1e9 for p in pulls]
        prep_us = pulls[0]["steady_prep_seconds"] * 1e6
        memcpy, memcpy_1 = _memcpy_gbps(nbytes, reps)
        median = statistics.median(gbps)
        return {
            "tokens": n_tokens,
            "blocks": n_blocks,
            "layout": "scattered" if scattered else "contiguous",
            "bytes": nbytes,
            "descriptors": pulls[0]["descriptors"],
            "reps": reps,
            "gbps": median,
            "gbps_best": max(gbps),
            "memcpy_gbps": memcpy,
            "memcpy_1thread_gbps": memcpy_1,
            "ratio": median / memcpy,
            "ratio_vs_1thread": median / memcpy_1,
            "pull_ms_p50": statistics.median(p["seconds"] for p in pulls) * 1e3,
            "prep_us_per_request": prep_us,
            "prep_us_in_pull": statistics.median(p["prep_seconds"] for p in pulls) * 1e6,
            "prep_us_per_1000_blocks": prep_us / (n_blocks / 1000),
            "prep_us_per_1000_descriptors": prep_us / (pulls[0]["descriptors"] / 1000),
            "verified": bool(pulls[0]["verified"]),
        }

    def close(self) -> bool:
        full = self.pool.free_count == self.pool.num_blocks
        self.transport.close()
        return full


def _memcpy_gbps(nbytes: int, reps: int) -> tuple[float, float]:
    """Median torch copy bandwidth of ``nbytes`` (default threads, then one thread)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # both buffers faulted in before timing
    threads = torch.get_num_threads()
    figures = []
    for n_threads in (threads, 1):
        torch.set_num_threads(n_threads)
        samples = []
        for _ in range(max(reps, 3)):
            started = time.perf_counter()
            dst.copy_(src)
            samples.append(nbytes / (time.perf_counter() - started) / 1e9)
        figures.append(statistics.median(samples))
    torch.set_num_threads(threads)
    return figures[0], figures[1]


def _producer_main(conn: Connection, geometry: _Geometry) -> None:
    """The producer worker: serve reads, hold leases until notified, answer commands."""
    try:
        pool = KVBlockPool(geometry.pool_spec())
        pool.buffer.view(torch.int16).random_()
        transport = NixlTransport(
            pool,
            WorkerIdentity(PRODUCER_ENGINE, 1, 0, 0),
            config=geometry.nixl_config(),
        )
        producer = KVProducer(transport, default_lease_s=120.0)
        record = transport.handshake_record(worker_id="bench", compat_hash=geometry.compat_hash())
        engine = geometry.engine_record(PRODUCER_ENGINE, EngineRole.PREFILL)
        conn.send(("ok", (encode(record), encode(engine))))
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        if conn.poll(0.0005):
            command, arg = conn.recv()
            try:
                if command == "stop":
                    deadline = time.monotonic() + 5.0
                    while len(producer.leases) and time.monotonic() < deadline:
                        producer.poll()
                        time.sleep(0.001)
                    for leftover in producer.leases.request_ids():
                        producer.abort(leftover)
                    answer: Any = (pool.free_count, pool.num_blocks)
                    transport.close()
                    conn.send(("ok", answer))
                    return
                request_id, n_blocks, scattered, verify = arg
                deadline = time.monotonic() + 10.0  # the previous pull's notification may lag
                while pool.free_count < n_blocks and time.monotonic() < deadline:
                    producer.poll()
                    time.sleep(0.0005)
                blocks = pool.allocate(n_blocks)
                if scattered:
                    blocks = tuple(blocks[i] for i in torch.randperm(n_blocks).tolist())
                checksum = _checksum(pool, _sample(blocks)) if verify else None
                producer.hold(request_id, blocks)
                pool.free(blocks)
                conn.send(("ok", (blocks, checksum)))
            except Exception:
                conn.send(("err", traceback.format_exc()))
        producer.poll()


__all__ = ["add_arguments", "run"]
