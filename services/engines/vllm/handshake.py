"""vLLM handshake payloads <-> control-plane records, and the bridge to Redis from vLLM's threads.

Mapping (one :class:`HandshakeRecord` per ``(pp_rank, tp_rank)`` of the vLLM engine):

- the record's geometry describes the rank's KV shard as pdserve's aggregation checks it: the
  layer range vLLM gives the stage (:func:`~services.engines.vllm.layouts.vllm_layer_ranges`),
  the KV-head range of the TP rank, block size, dtype, head size, and the NIXL regions vLLM
  registered: one per layer with K and V packed in each head's page (``HNC``, vLLM 0.32's
  ``LBHNC``, what its CPU and GPU attention backends use), or two per layer (``HND``);
- ``agent_metadata`` is the rank's NIXL agent blob; ``extra`` is :class:`VllmHandshakeExtra`:
  vLLM's own encoded ``NixlHandshakePayload`` (its compatibility hash and full agent metadata,
  decoded by the peer exactly as the ZMQ side channel would have delivered it), the transfer
  mode and the scheduler's clocks at publication (for the block-expiry clock offset).

vLLM engine ids are ``<engine_id>.g<generation>`` (:func:`vllm_engine_id`): a restarted prefill
is a different NIXL engine to its peers, so nobody reads from a dead agent under a reused name.

:class:`ControlPlaneBridge` runs a :class:`RedisControlPlane` on a private event loop thread, so
vLLM's synchronous scheduler and its handshake threads can publish and resolve with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from services.codec import MsgpackBounds, UnpackError, unpack_bounded
from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.aggregation import DTYPE_BYTES, EngineTopology
from services.control_plane.base import EngineView
from services.control_plane.errors import ControlPlaneError
from services.control_plane.wire import (
    KV_REGIONS_PER_LAYER,
    EngineId,
    EngineRecord,
    EngineStatus,
    Generation,
    HandshakeRecord,
    kv_block_len,
)
from services.engines.vllm.layouts import TransferMode, UnsupportedVllmLayout, vllm_layer_ranges
from services.topology import ModelShape, kv_head_range

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Protocol history of VllmHandshakeExtra:
#   1: first version (payload, transfer mode, scheduler clocks).
EXTRA_VERSION = 1
MAX_EXTRA_BYTES = 2 * 1024 * 1024
EXTRA_CONFIG_KEY = "pdserve"
"""The key of pdserve's settings inside vLLM's ``kv_connector_extra_config``."""
REDIS_PASSWORD_ENV = "PDSERVE_VLLM_REDIS_PASSWORD"
"""The default environment variable carrying the Redis password into vLLM's processes."""


class HandshakeResolutionError(RuntimeError):
    """A remote engine's handshake cannot be resolved from the control plane (not READY, another
    generation, an undecodable payload); the request that needed it fails, counted by vLLM."""


def vllm_engine_id(engine_id: EngineId, generation: Generation) -> str:
    """The NIXL engine id vLLM uses for one pdserve engine generation."""
    return f"{engine_id}.g{generation}"


def parse_vllm_engine_id(value: str) -> tuple[EngineId, Generation]:
    """Inverse of :func:`vllm_engine_id`; raises :class:`HandshakeResolutionError`."""
    engine_id, sep, generation = value.rpartition(".g")
    if not sep or not engine_id or not generation.isdigit():
        raise HandshakeResolutionError(f"{value!r} is not a pdserve vLLM engine id")
    return engine_id, int(generation)


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector in vLLM's processes needs, carried in ``kv_connector_extra_config``.

    The Redis password never travels in the config (vLLM logs it): the backend puts it in the
    environment variable named by ``redis_password_env``, which vLLM's processes inherit.
    """

    engine_id: EngineId
    generation: Generation
    control_plane: ControlPlaneSettings
    transfer_mode: TransferMode = TransferMode.PUSH
    compat_hash: str | None = None
    """The engine's control-plane compatibility hash (model and KV geometry): its workers
    pre-warm only peers with the same (the router never pairs others, and their handshakes
    would fail). ``None`` only in tests that build a worker by hand: every peer."""
    resolve_timeout_s: float = 10.0
    redis_password_env: str = REDIS_PASSWORD_ENV

    @property
    def vllm_engine_id(self) -> str:
        return vllm_engine_id(self.engine_id, self.generation)

    def to_extra_config(self) -> dict[str, Any]:
        control_plane = self.control_plane.model_dump(mode="json")
        control_plane["redis"].pop("password", None)
        return {
            EXTRA_CONFIG_KEY: {
                "engine_id": self.engine_id,
                "generation": self.generation,
                "control_plane": control_plane,
                "transfer_mode": self.transfer_mode.value,
                "compat_hash": self.compat_hash,
                "resolve_timeout_s": self.resolve_timeout_s,
                "redis_password_env": self.redis_password_env,
            }
        }

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        """Parse and validate; raises ``ValueError`` naming what is missing or wrong."""
        raw = extra.get(EXTRA_CONFIG_KEY)
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"kv_connector_extra_config has no {EXTRA_CONFIG_KEY!r} section: pdserve's "
                "connector is configured by the vllm backend (VllmBackend.start)"
            )
        try:
            control_plane = dict(raw["control_plane"])
            password_env = str(raw.get("redis_password_env", REDIS_PASSWORD_ENV))
            password = os.environ.get(password_env)
            if password:
                control_plane["redis"] = {**control_plane["redis"], "password": password}
            return cls(
                engine_id=str(raw["engine_id"]),
                generation=int(raw["generation"]),
                control_plane=ControlPlaneSettings.model_validate(control_plane),
                transfer_mode=TransferMode(raw.get("transfer_mode", "push")),
                compat_hash=None if raw.get("compat_hash") is None else str(raw["compat_hash"]),
                resolve_timeout_s=float(raw.get("resolve_timeout_s", 10.0)),
                redis_password_env=password_env,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid pdserve connector settings: {exc}") from exc


_EXTRA_BOUNDS = MsgpackBounds(
    max_bytes=MAX_EXTRA_BYTES,
    max_str_len=MAX_EXTRA_BYTES,
    max_bin_len=MAX_EXTRA_BYTES,
    max_array_len=0,
    max_map_len=8,
)


@dataclass(frozen=True)
class VllmHandshakeExtra:
    """The ``extra`` of a vLLM engine's handshake record (see the module docstring)."""

    nixl_payload: bytes
    """vLLM's msgspec-encoded ``NixlHandshakePayload`` for this rank."""
    transfer_mode: TransferMode
    scheduler_perf_s: float
    """The scheduler's ``time.perf_counter()`` at publication (vLLM stamps expiries with it)."""
    scheduler_wall_s: float
    """``time.time()`` at the same instant."""

    def encode(self) -> bytes:
        data: bytes = msgpack.packb(
            {
                "v": EXTRA_VERSION,
                "payload": self.nixl_payload,
                "mode": self.transfer_mode.value,
                "perf": self.scheduler_perf_s,
                "wall": self.scheduler_wall_s,
            },
            use_bin_type=True,
        )
        return data

    @classmethod
    def decode(cls, data: bytes) -> VllmHandshakeExtra:
        """Strict decode; raises :class:`HandshakeResolutionError` (Redis is a trust boundary)."""
        try:
            raw = unpack_bounded(data, _EXTRA_BOUNDS)
        except UnpackError as exc:
            raise HandshakeResolutionError(f"vLLM handshake extra: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("v") != EXTRA_VERSION:
            raise HandshakeResolutionError("vLLM handshake extra has another version or shape")
        payload, mode, perf, wall = (
            raw.get("payload"),
            raw.get("mode"),
            raw.get("perf"),
            raw.get("wall"),
        )
        if (
            not isinstance(payload, bytes)
            or mode not in {m.value for m in TransferMode}
            or not isinstance(perf, float)
            or not isinstance(wall, float)
        ):
            raise HandshakeResolutionError("vLLM handshake extra has invalid fields")
        return cls(payload, TransferMode(mode), perf, wall)

    def clock_offset(self, *, now_perf: float, now_wall: float) -> float:
        """The remote scheduler's ``perf_counter`` minus ours, as vLLM's ZMQ handshake
        estimates it (remote - local midpoint); here from the wall clocks, so it is as good as
        the hosts' clock sync (NTP: milliseconds against leases of tens of seconds)."""
        local_perf_at_publication = now_perf - (now_wall - self.scheduler_wall_s)
        return self.scheduler_perf_s - local_perf_at_publication


@dataclass(frozen=True)
class RankTransferInfo:
    """What pdserve's record needs from one rank's vLLM ``NixlAgentMetadata``."""

    agent_metadata: bytes
    region_base_addrs: tuple[int, ...]
    num_blocks: int
    block_len: int
    block_stride: int
    block_size: int
    memory_type: str
    device_id: int
    nixl_payload: bytes


def build_records(
    engine: EngineRecord,
    ranks: Mapping[tuple[int, int], RankTransferInfo],
    shape: ModelShape,
    *,
    transfer_mode: TransferMode,
    perf_s: float,
    wall_s: float,
) -> list[HandshakeRecord]:
    """One record per rank of ``engine`` whose model is ``shape`` (cut into stages as vLLM cuts
    them: :func:`vllm_layer_ranges`), or :class:`UnsupportedVllmLayout` when vLLM's registration
    does not have the shape pdserve describes (an unexpected layout must fail at start-up,
    loudly)."""
    element = DTYPE_BYTES.get(shape.dtype)
    if element is None:
        raise UnsupportedVllmLayout(f"KV cache dtype {shape.dtype!r} is not supported")
    layer_ranges = vllm_layer_ranges(shape.num_layers, shape.pp_size, shape.layer_partition)
    if len(layer_ranges) != engine.shape.pp_size:
        raise UnsupportedVllmLayout(
            f"{len(layer_ranges)} layer ranges for PP={engine.shape.pp_size}"
        )
    records = []
    for (pp_rank, tp_rank), info in sorted(ranks.items()):
        if not (0 <= pp_rank < engine.shape.pp_size and 0 <= tp_rank < engine.shape.tp_size):
            raise UnsupportedVllmLayout(
                f"vLLM reported rank ({pp_rank}, {tp_rank}) outside PP={engine.shape.pp_size} x "
                f"TP={engine.shape.tp_size}"
            )
        layers = layer_ranges[pp_rank]
        heads = kv_head_range(shape.num_kv_heads, engine.shape.tp_size, tp_rank)
        where = f"rank ({pp_rank}, {tp_rank})"
        kv_layout = _kv_layout(len(info.region_base_addrs), len(layers), where)
        expected_len = kv_block_len(
            kv_layout,
            heads=len(heads),
            block_size=info.block_size,
            head_size=shape.head_size,
            element=element,
        )
        if info.block_len != expected_len:
            raise UnsupportedVllmLayout(
                f"{where}: vLLM block length {info.block_len} bytes != {expected_len} (heads x "
                f"block x head_size x dtype in {kv_layout}): not a head-major page"
            )
        extra = VllmHandshakeExtra(info.nixl_payload, transfer_mode, perf_s, wall_s)
        records.append(
            HandshakeRecord(
                engine_id=engine.engine_id,
                generation=engine.generation,
                pp_rank=pp_rank,
                tp_rank=tp_rank,
                worker_id=f"vllm-{engine.engine_id}-g{engine.generation}-pp{pp_rank}-tp{tp_rank}",
                agent_name=f"{vllm_engine_id(engine.engine_id, engine.generation)}"
                f"-pp{pp_rank}-tp{tp_rank}",
                agent_metadata=info.agent_metadata,
                memory_type=info.memory_type,
                device_id=info.device_id,
                region_base_addrs=info.region_base_addrs,
                num_blocks=info.num_blocks,
                block_len=info.block_len,
                block_stride=info.block_stride,
                block_size=info.block_size,
                dtype=shape.dtype,
                head_size=shape.head_size,
                kv_layout=kv_layout,
                layers=layers,
                kv_heads=heads,
                compat_hash=engine.compat_hash,
                extra=extra.encode(),
            )
        )
    return records


def _kv_layout(num_regions: int, num_layers: int, where: str) -> str:
    """The record layout of what vLLM registered: one region per layer (vLLM 0.32's packed
    ``LBHNC``) or two (K and V apart)."""
    for layout, per_layer in KV_REGIONS_PER_LAYER.items():
        if num_regions == per_layer * num_layers:
            return layout
    raise UnsupportedVllmLayout(
        f"{where}: vLLM registered {num_regions} KV regions for {num_layers} layers; pdserve's "
        "connector describes one region per layer (K and V packed) or two (K and V apart)"
    )


def resolve_extras(
    topology: EngineTopology,
    expected_engine_id: str,
    *,
    remote_pp_size: int,
    remote_tp_size: int,
    tp_ranks: list[int],
    expected_mode: TransferMode,
) -> dict[tuple[int, int], VllmHandshakeExtra]:
    """The handshake extras a worker needs from a READY topology, or
    :class:`HandshakeResolutionError` (another generation, a layout other than the request's,
    a peer of the other transfer mode: push and pull connectors are protocol-incompatible)."""
    engine_id, generation = parse_vllm_engine_id(expected_engine_id)
    engine = topology.engine
    if engine.engine_id != engine_id or engine.generation != generation:
        raise HandshakeResolutionError(
            f"{expected_engine_id} is gone: {engine.engine_id} is at generation {engine.generation}"
        )
    if (engine.shape.pp_size, engine.shape.tp_size) != (remote_pp_size, remote_tp_size):
        raise HandshakeResolutionError(
            f"{expected_engine_id}: kv_transfer_params say PP={remote_pp_size} "
            f"TP={remote_tp_size}, the control plane "
            f"PP={engine.shape.pp_size} TP={engine.shape.tp_size}"
        )
    extras = {}
    for pp_rank in range(remote_pp_size):
        for tp_rank in tp_ranks:
            record = topology.records.get((pp_rank, tp_rank))
            if record is None:
                raise HandshakeResolutionError(f"{expected_engine_id}: no rank {pp_rank}:{tp_rank}")
            extra = VllmHandshakeExtra.decode(record.extra)
            if extra.transfer_mode is not expected_mode:
                raise HandshakeResolutionError(
                    f"{expected_engine_id} publishes {extra.transfer_mode.value} mode, this "
                    f"engine is {expected_mode.value} mode: push and pull are incompatible"
                )
            extras[(pp_rank, tp_rank)] = extra
    return extras


class ControlPlaneBridge:
    """A :class:`RedisControlPlane` on its own event loop thread, for vLLM's synchronous code.

    Every call is bounded by ``timeout_s``. :meth:`follow` runs a watcher on the same loop and
    calls ``on_change(view)`` (from the loop thread) for every engine change, READY included.
    """

    def __init__(self, settings: ControlPlaneSettings, *, timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pdserve-control-plane", daemon=True
        )
        self._thread.start()
        self.control_plane = self._call(self._make(settings))
        self._watch_task: Future[None] | None = None

    @staticmethod
    async def _make(settings: ControlPlaneSettings) -> RedisControlPlane:
        return RedisControlPlane(settings)

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s if timeout_s is not None else self._timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on this bridge's loop thread (where ``follow`` calls back)."""
        return threading.current_thread() is self._thread

    def get_engine(self, engine_id: EngineId) -> EngineView | None:
        return self._call(self.control_plane.get_engine(engine_id))

    def publish(self, engine: EngineRecord, records: list[HandshakeRecord]) -> EngineStatus | None:
        return self._call(self.control_plane.publish_handshakes(engine, records))

    def topology(self, engine_id: EngineId) -> EngineTopology:
        return self._call(self.control_plane.get_topology(engine_id))

    def resolve(
        self,
        expected_engine_id: str,
        *,
        remote_pp_size: int,
        remote_tp_size: int,
        tp_ranks: list[int],
        expected_mode: TransferMode,
    ) -> dict[tuple[int, int], VllmHandshakeExtra]:
        """Read the remote engine's READY topology and :func:`resolve_extras` from it."""
        engine_id, _generation = parse_vllm_engine_id(expected_engine_id)
        try:
            topology = self.topology(engine_id)
        except ControlPlaneError as exc:
            raise HandshakeResolutionError(f"{expected_engine_id}: {exc}") from exc
        return resolve_extras(
            topology,
            expected_engine_id,
            remote_pp_size=remote_pp_size,
            remote_tp_size=remote_tp_size,
            tp_ranks=tp_ranks,
            expected_mode=expected_mode,
        )

    def follow(self, on_change: Callable[[EngineView | None, EngineId], None]) -> None:
        """Start watching (idempotent); returns once the first snapshot was delivered."""
        if self._watch_task is not None:
            return
        synced = threading.Event()

        async def run() -> None:
            async with self.control_plane.watch() as watcher:
                for engine_id, view in watcher.snapshot.items():
                    on_change(view, engine_id)
                synced.set()
                async for change in watcher:
                    on_change(change.after, change.engine_id)

        self._watch_task = asyncio.run_coroutine_threadsafe(run(), self._loop)
        if not synced.wait(self._timeout_s):
            raise TimeoutError(f"control-plane watcher not synced within {self._timeout_s}s")

    def close(self) -> None:
        """Stop the watcher, close Redis and the loop thread. Idempotent."""
        if not self._thread.is_alive():
            return
        if self._watch_task is not None:
            self._watch_task.cancel()
        with contextlib.suppress(Exception):
            self._call(self.control_plane.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()


def now_clocks() -> tuple[float, float]:
    """``(perf_counter, time)`` read together."""
    return time.perf_counter(), time.time()
