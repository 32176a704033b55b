"""The control plane on Redis: :class:`RedisControlPlane`, the :class:`ControlPlane` in use."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from services.config import ControlPlaneSettings
from services.control_plane import scripts
from services.control_plane.aggregation import (
    EngineTopology,
    aggregate,
    check_record,
    rank_field,
)
from services.control_plane.base import ControlPlane, EngineInspection, EngineSpec, EngineView
from services.control_plane.connection import RedisConnection
from services.control_plane.errors import (
    ControlPlaneError,
    DuplicateRankError,
    EngineNotFound,
    EngineNotReady,
    HandshakeRejected,
    PipelineParallelUnsupported,
    RecordDecodeError,
    StaleGenerationError,
)
from services.control_plane.keys import KeySpace
from services.control_plane.metrics import ControlPlaneMetrics
from services.control_plane.watch import EngineWatcher
from services.control_plane.wire import (
    EngineId,
    EngineLoad,
    EngineRecord,
    EngineState,
    EngineStatus,
    Event,
    EventKind,
    Generation,
    HandshakeRecord,
    decode,
    encode,
    validate_identifier,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisControlPlane(ControlPlane):
    """:class:`ControlPlane` on one Redis (standalone; keys of one engine are built in Lua)."""

    def __init__(
        self, settings: ControlPlaneSettings, metrics: ControlPlaneMetrics | None = None
    ) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else ControlPlaneMetrics()
        self.keys = KeySpace(settings.namespace)
        self.connection = RedisConnection(settings.redis, self.metrics)
        client = self.connection.client
        self._next_generation = client.register_script(scripts.NEXT_GENERATION)
        self._register = client.register_script(scripts.REGISTER)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._deregister = client.register_script(scripts.DEREGISTER)
        self._prune_expired = client.register_script(scripts.PRUNE_EXPIRED)
        self._publish = client.register_script(scripts.PUBLISH_HANDSHAKES)
        self._withdraw = client.register_script(scripts.WITHDRAW_HANDSHAKE)
        self._set_status = client.register_script(scripts.SET_STATUS)

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.settings.lease_ttl_s * 1000)

    @property
    def round_trips(self) -> int:
        return self.connection.round_trips

    # -- engine host ------------------------------------------------------------------------

    async def register(self, spec: EngineSpec) -> EngineRecord:
        validate_identifier(spec.engine_id)
        shape = spec.shape
        if shape.pp_size < 1 or shape.tp_size < 1 or shape.num_layers < shape.pp_size:
            raise ValueError(f"invalid layout PP={shape.pp_size} TP={shape.tp_size}")
        if shape.pp_size > 1 and not spec.pp_aware:
            raise PipelineParallelUnsupported(
                f"engine {spec.engine_id} declares itself not PP-aware but asks for "
                f"PP={shape.pp_size}"
            )
        counter = self.keys.generation_counter(spec.engine_id)
        now = _now_ms()
        generation = await self.connection.call(
            "register", lambda: self._next_generation([counter], [now])
        )
        return await self._register_at(spec, int(generation), now)

    async def restore(self, spec: EngineSpec, generation: Generation) -> EngineRecord:
        validate_identifier(spec.engine_id)
        record = await self._register_at(spec, generation, _now_ms())
        logger.warning(
            "restored engine %s generation %d after its lease ran out", spec.engine_id, generation
        )
        return record

    async def _register_at(self, spec: EngineSpec, generation: int, now: int) -> EngineRecord:
        """Store ``spec`` PENDING at ``generation``, which must still be the engine's newest
        (the REGISTER script compares it with the generation counter)."""
        counter = self.keys.generation_counter(spec.engine_id)
        record = spec.record(int(generation), lease_ttl_ms=self.lease_ttl_ms, registered_at_ms=now)
        status = EngineStatus(
            spec.engine_id,
            record.generation,
            EngineState.PENDING,
            ("missing_ranks: no handshake published yet",),
            0,
            now,
        )
        keys = [counter, *self.keys.lease_keys(spec.engine_id, record.generation)]
        keys += [self.keys.engines, self.keys.events]
        args: list[Any] = [
            record.generation,
            encode(record),
            encode(status),
            self.lease_ttl_ms,
            spec.engine_id,
            now,
            self._event(record, EventKind.REGISTERED),
        ]
        code = await self.connection.call("register", lambda: self._register(keys, args))
        if code != 1:
            raise StaleGenerationError(
                f"engine {spec.engine_id} was registered again while registering generation "
                f"{record.generation}"
            )
        logger.info(
            "registered engine %s generation %d (%s, PP=%d TP=%d)",
            spec.engine_id,
            record.generation,
            spec.role.value,
            spec.shape.pp_size,
            spec.shape.tp_size,
        )
        return record

    async def heartbeat(
        self, engine_id: EngineId, generation: Generation, load: EngineLoad | None = None
    ) -> None:
        keys = [*self.keys.lease_keys(engine_id, generation), self.keys.engines]
        load_bytes = encode(load) if load is not None else b""
        args: list[Any] = [generation, self.lease_ttl_ms, load_bytes, engine_id, _now_ms()]
        code = await self.connection.call("heartbeat", lambda: self._heartbeat(keys, args))
        self._check_fence(code, engine_id, generation)

    async def deregister(self, engine_id: EngineId, generation: Generation) -> None:
        keys = [*self.keys.lease_keys(engine_id, generation), self.keys.engines, self.keys.events]
        event = encode(Event(engine_id, generation, EventKind.DEREGISTERED))
        args: list[Any] = [generation, engine_id, event]
        code = await self.connection.call("deregister", lambda: self._deregister(keys, args))
        self._check_fence(code, engine_id, generation)
        logger.info("deregistered engine %s generation %d", engine_id, generation)

    # -- workers ----------------------------------------------------------------------------

    async def publish_handshakes(
        self, engine: EngineRecord, records: Sequence[HandshakeRecord]
    ) -> EngineStatus | None:
        if not records:
            raise ValueError("publish_handshakes needs at least one record")
        for record in records:
            problems = check_record(engine, record)
            if problems:
                for problem in problems:
                    self.metrics.records_rejected.labels(reason=problem.reason).inc()
                error = (
                    PipelineParallelUnsupported
                    if any(p.reason == "not_pp_aware" for p in problems)
                    else HandshakeRejected
                )
                raise error(
                    f"handshake of {engine.engine_id} rank ({record.pp_rank}, {record.tp_rank}) "
                    "rejected: " + "; ".join(str(p) for p in problems)
                )
        eid, gen = engine.engine_id, engine.generation
        keys = [
            self.keys.current(eid),
            self.keys.engine(eid),
            self.keys.handshakes(eid, gen),
            self.keys.owners(eid, gen),
            self.keys.handshake_version(eid, gen),
            self.keys.events,
        ]
        args: list[Any] = [gen, self.lease_ttl_ms, engine.shape.world_size]
        args.append(self._event(engine, EventKind.HANDSHAKE))
        for record in records:
            args += [rank_field(record.pp_rank, record.tp_rank), record.worker_id, encode(record)]
        reply: list[Any] = await self.connection.call(
            "publish_handshakes", lambda: self._publish(keys, args)
        )
        code = int(reply[0])
        if code == -3:
            holder = reply[2].decode(errors="replace")
            raise DuplicateRankError(
                f"engine {eid}@{gen}: rank {reply[1].decode(errors='replace')} is already held "
                f"by worker {holder}"
            )
        self._check_fence(code, eid, gen)
        self.metrics.handshakes_published.labels(engine=eid).inc(len(records))
        if len(reply) < 3:
            return None
        # This call completed the grid: judge it and announce the verdict.
        version, stored_engine = code, reply[2]
        fields = {reply[i].decode(errors="replace"): reply[i + 1] for i in range(3, len(reply), 2)}
        try:
            current = decode(stored_engine, EngineRecord)
        except RecordDecodeError as exc:
            self.metrics.records_rejected.labels(reason=exc.reason).inc()
            raise ControlPlaneError(f"stored record of engine {eid} is unreadable: {exc}") from exc
        return await self._judge(current, fields, version)

    async def withdraw_handshake(
        self, engine: EngineRecord, pp_rank: int, tp_rank: int, worker_id: str
    ) -> None:
        eid, gen = engine.engine_id, engine.generation
        keys = [
            self.keys.current(eid),
            self.keys.handshakes(eid, gen),
            self.keys.owners(eid, gen),
            self.keys.handshake_version(eid, gen),
            self.keys.events,
        ]
        args: list[Any] = [
            gen,
            rank_field(pp_rank, tp_rank),
            worker_id,
            self._event(engine, EventKind.HANDSHAKE),
        ]
        version = await self.connection.call("withdraw", lambda: self._withdraw(keys, args))
        self._check_fence(version, eid, gen)
        if version == 0:
            return
        status = EngineStatus(
            eid,
            gen,
            EngineState.PENDING,
            (f"missing_ranks: rank ({pp_rank}, {tp_rank}) withdrew",),
            int(version),
            _now_ms(),
        )
        await self._write_status(engine, status)

    async def _judge(
        self, engine: EngineRecord, fields: dict[str, bytes], version: int
    ) -> EngineStatus | None:
        verdict = aggregate(engine, fields)
        for problem in verdict.problems:
            self.metrics.records_rejected.labels(reason=problem.reason).inc()
        now = _now_ms()
        ready = verdict.state is EngineState.READY
        status = EngineStatus(
            engine.engine_id,
            engine.generation,
            verdict.state,
            tuple(str(p) for p in verdict.problems),
            version,
            now,
            now - engine.registered_at_ms if ready else -1,
        )
        if not await self._write_status(engine, status):
            return None
        if ready:
            self.metrics.readiness_latency.labels(engine=engine.engine_id).observe(
                max(status.ready_latency_ms, 0) / 1000
            )
            logger.info(
                "engine %s generation %d READY (%d ranks)",
                engine.engine_id,
                engine.generation,
                engine.shape.world_size,
            )
        else:
            logger.warning(
                "engine %s generation %d %s: %s",
                engine.engine_id,
                engine.generation,
                verdict.state.value.upper(),
                "; ".join(status.problems),
            )
        return status

    async def _write_status(self, engine: EngineRecord, status: EngineStatus) -> bool:
        eid = engine.engine_id
        keys = [
            self.keys.current(eid),
            self.keys.status(eid),
            self.keys.handshake_version(eid, engine.generation),
            self.keys.events,
        ]
        event = encode(Event(eid, engine.generation, EventKind.STATE, status.state.value))
        args: list[Any] = [engine.generation, status.handshake_version, encode(status), event]
        code = await self.connection.call("set_status", lambda: self._set_status(keys, args))
        self._check_fence(code, eid, engine.generation)
        # 0: a newer handshake arrived meanwhile; its publisher judges the newer grid.
        return bool(code == 1)

    # -- readers ----------------------------------------------------------------------------

    async def list_engines(self) -> list[EngineView]:
        client = self.connection.client
        ids_raw: list[bytes] = await self.connection.call(
            "list_engines",
            lambda: client.zrange(self.keys.engines, 0, -1),  # type: ignore[arg-type,return-value]
        )
        ids = sorted(i.decode(errors="replace") for i in ids_raw)
        if not ids:
            return []
        values = await self.connection.call("list_engines", lambda: self._read_many(ids))
        views: list[EngineView] = []
        expired: list[str] = []
        for engine_id, (current, *parts) in zip(ids, values, strict=True):
            if current is None:
                expired.append(engine_id)
                continue
            views.append(self._view(engine_id, *parts))
        if expired:
            removed = await self._prune(expired)
            if removed:
                self.metrics.leases_expired.inc(len(removed))
                logger.warning("leases expired without deregistration: %s", ", ".join(removed))
        return views

    async def _prune(self, expired: Sequence[EngineId]) -> list[EngineId]:
        """Remove from the index those of ``expired`` whose lease is still gone; the removed.

        One script, so an engine that registered again since it was read stays listed.
        """
        keys = [self.keys.engines, *(self.keys.current(e) for e in expired)]
        removed: list[bytes] = await self.connection.call(
            "prune_expired", lambda: self._prune_expired(keys, list(expired))
        )
        return [r.decode(errors="replace") for r in removed]

    async def get_engine(self, engine_id: EngineId) -> EngineView | None:
        return (await self.get_engines([engine_id]))[engine_id]

    async def get_engines(
        self, engine_ids: Sequence[EngineId]
    ) -> dict[EngineId, EngineView | None]:
        for engine_id in engine_ids:
            validate_identifier(engine_id)
        ids = list(engine_ids)
        values = await self.connection.call("get_engines", lambda: self._read_many(ids))
        return {
            engine_id: self._view(engine_id, *parts) if current is not None else None
            for engine_id, (current, *parts) in zip(ids, values, strict=True)
        }

    async def inspect(self, engine_id: EngineId) -> EngineInspection | None:
        view = await self.get_engine(engine_id)
        if view is None:
            return None
        if view.record is None:
            return EngineInspection(view, None)
        fields = await self._read_handshakes(view.record)
        return EngineInspection(view, aggregate(view.record, fields))

    async def get_topology(self, engine_id: EngineId) -> EngineTopology:
        view = await self.get_engine(engine_id)
        if view is None:
            raise EngineNotFound(f"engine {engine_id} has no live registration")
        if view.record is None or not view.ready:
            problems = view.status.problems if view.status else view.problems
            raise EngineNotReady(f"engine {engine_id} is not READY", problems)
        fields = await self._read_handshakes(view.record)
        verdict = aggregate(view.record, fields)
        if verdict.topology is None:
            for problem in verdict.problems:
                self.metrics.records_rejected.labels(reason=problem.reason).inc()
            raise EngineNotReady(
                f"engine {engine_id} is announced READY but its records no longer validate",
                tuple(str(p) for p in verdict.problems),
            )
        return verdict.topology

    def watch(self, *, handshake_progress: bool = False) -> EngineWatcher:
        return EngineWatcher(self, handshake_progress=handshake_progress)

    async def close(self) -> None:
        await self.connection.close()

    # -- helpers ----------------------------------------------------------------------------

    async def _read_many(self, ids: list[str]) -> list[list[bytes | None]]:
        pipe = self.connection.client.pipeline(transaction=False)
        for engine_id in ids:
            pipe.get(self.keys.current(engine_id))
            pipe.get(self.keys.engine(engine_id))
            pipe.get(self.keys.status(engine_id))
            pipe.get(self.keys.load(engine_id))
        flat = await pipe.execute()
        return [flat[i : i + 4] for i in range(0, len(flat), 4)]

    async def _read_handshakes(self, record: EngineRecord) -> dict[str, bytes]:
        key = self.keys.handshakes(record.engine_id, record.generation)
        raw: dict[bytes, bytes] = await self.connection.call(
            "read_handshakes",
            lambda: self.connection.client.hgetall(key),  # type: ignore[arg-type,return-value]
        )
        return {name.decode(errors="replace"): value for name, value in raw.items()}

    def _view(
        self,
        engine_id: str,
        engine_raw: bytes | None,
        status_raw: bytes | None,
        load_raw: bytes | None,
    ) -> EngineView:
        problems: list[str] = []
        record = self._decode_part(engine_raw, EngineRecord, problems)
        status = self._decode_part(status_raw, EngineStatus, problems)
        load = self._decode_part(load_raw, EngineLoad, problems)
        if record is not None and record.engine_id != engine_id:
            problems.append(f"contradictory: engine record says {record.engine_id}")
            self.metrics.records_rejected.labels(reason="contradictory").inc()
            record = None
        return EngineView(engine_id, record, status, load, tuple(problems))

    def _decode_part(self, raw: bytes | None, cls: type[T], problems: list[str]) -> T | None:
        if raw is None:
            return None
        try:
            return decode(raw, cls)
        except RecordDecodeError as exc:
            self.metrics.records_rejected.labels(reason=exc.reason).inc()
            problems.append(f"{exc.reason}: {exc}")
            logger.warning("rejected stored value: %s", exc)
            return None

    @staticmethod
    def _event(engine: EngineRecord, kind: EventKind) -> bytes:
        return encode(Event(engine.engine_id, engine.generation, kind))

    @staticmethod
    def _check_fence(code: Any, engine_id: EngineId, generation: Generation) -> None:
        code = int(code)
        if code == -1:
            raise EngineNotFound(
                f"engine {engine_id} has no live lease (expired or deregistered); register again"
            )
        if code == -2:
            raise StaleGenerationError(
                f"engine {engine_id} generation {generation} was replaced by a newer generation"
            )
