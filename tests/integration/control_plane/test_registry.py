"""Registry, leases, generations and READY announcement against a real Redis."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.synchronize
import time
import uuid
from dataclasses import replace

import pytest

from services.config import ControlPlaneSettings
from services.control_plane import (
    ControlPlaneMetrics,
    DuplicateRankError,
    EngineNotFound,
    EngineNotReady,
    EngineRecord,
    EngineState,
    HandshakeRejected,
    PipelineParallelUnsupported,
    RedisControlPlane,
    StaleGenerationError,
)
from services.control_plane.synthetic import synthetic_records, synthetic_spec
from services.control_plane.wire import EngineLoad, decode, encode
from services.topology import Range
from tests.conftest import counter_value

pytestmark = pytest.mark.integration


async def _ready_engine(
    cp: RedisControlPlane, engine_id: str, pp: int = 2, tp: int = 2
) -> EngineRecord:
    engine = await cp.register(synthetic_spec(engine_id, pp_size=pp, tp_size=tp))
    status = await cp.publish_handshakes(engine, list(synthetic_records(engine).values()))
    assert status is not None and status.state is EngineState.READY
    return engine


async def test_registration_is_listed_pending_with_a_new_generation(
    control_plane: RedisControlPlane,
) -> None:
    before_ms = int(time.time() * 1000)
    engine = await control_plane.register(synthetic_spec("prefill-0", pp_size=2, tp_size=2))
    assert engine.generation >= before_ms  # unique even if Redis forgets its counter
    views = await control_plane.list_engines()
    assert [v.engine_id for v in views] == ["prefill-0"]
    assert views[0].state is EngineState.PENDING
    assert views[0].record == engine


async def test_full_grid_turns_ready_and_serves_its_topology(
    control_plane: RedisControlPlane,
) -> None:
    engine = await control_plane.register(synthetic_spec("p", pp_size=2, tp_size=2, num_layers=7))
    records = list(synthetic_records(engine).values())
    for record in records[:-1]:
        assert await control_plane.publish_handshakes(engine, [record]) is None
        view = await control_plane.get_engine("p")
        assert view is not None and view.state is EngineState.PENDING
    with pytest.raises(EngineNotReady):
        await control_plane.get_topology("p")
    status = await control_plane.publish_handshakes(engine, [records[-1]])
    assert status is not None and status.state is EngineState.READY
    assert status.ready_latency_ms >= 0
    topology = await control_plane.get_topology("p")
    assert topology.layout.stage_layers(1) == Range(4, 7)
    assert set(topology.records) == {(0, 0), (0, 1), (1, 0), (1, 1)}


async def test_heartbeat_keeps_the_lease_and_stores_load(cp_settings: ControlPlaneSettings) -> None:
    # Beats 0.25 s apart for 2.5 s against a 1.5 s lease: alive only if every beat renewed it
    # (1.25 s of slack per beat, so a slow CI machine does not make this flaky).
    settings = cp_settings.model_copy(update={"lease_ttl_s": 1.5, "heartbeat_interval_s": 0.25})
    cp = RedisControlPlane(settings, ControlPlaneMetrics())
    try:
        engine = await _ready_engine(cp, "alive")
        for depth in range(10):
            await asyncio.sleep(0.25)
            await cp.heartbeat("alive", engine.generation, EngineLoad(queue_depth=depth))
        view = await cp.get_engine("alive")
        assert view is not None and view.ready
        assert view.load == EngineLoad(queue_depth=9)
        assert (1, 1) in (await cp.get_topology("alive")).records
    finally:
        await cp.close()


async def test_a_dead_engine_expires_after_its_lease(
    cp_settings: ControlPlaneSettings, metrics: ControlPlaneMetrics
) -> None:
    settings = cp_settings.model_copy(update={"lease_ttl_s": 0.5, "heartbeat_interval_s": 0.1})
    cp = RedisControlPlane(settings, metrics)
    try:
        engine = await _ready_engine(cp, "dies")
        async with cp.watch() as watcher:
            assert watcher.snapshot["dies"].ready
            first = await watcher.next_change(1.0)  # the initial sync reports what exists
            assert first.before is None and first.after is not None and first.after.ready
            change = await watcher.next_change(3.0)  # no heartbeat: the lease runs out
            assert change.engine_id == "dies" and change.after is None
        assert await cp.list_engines() == []
        assert counter_value(metrics, "pdserve_control_plane_leases_expired_total") == 1
        with pytest.raises(EngineNotFound, match="register again"):
            await cp.heartbeat("dies", engine.generation)
        with pytest.raises(EngineNotFound):
            await cp.get_topology("dies")
    finally:
        await cp.close()


async def test_reregistration_fences_the_old_generation(control_plane: RedisControlPlane) -> None:
    old = await _ready_engine(control_plane, "restarts")
    new = await control_plane.register(synthetic_spec("restarts", pp_size=2, tp_size=2))
    assert new.generation > old.generation
    with pytest.raises(StaleGenerationError):
        await control_plane.heartbeat("restarts", old.generation)
    with pytest.raises(StaleGenerationError):
        await control_plane.publish_handshakes(old, list(synthetic_records(old).values()))
    with pytest.raises(StaleGenerationError):
        await control_plane.deregister("restarts", old.generation)
    # The old generation's complete grid is never served as current.
    view = await control_plane.get_engine("restarts")
    assert view is not None and view.generation == new.generation
    assert view.state is EngineState.PENDING
    with pytest.raises(EngineNotReady):
        await control_plane.get_topology("restarts")
    await control_plane.publish_handshakes(new, list(synthetic_records(new).values()))
    topology = await control_plane.get_topology("restarts")
    assert {r.generation for r in topology.records.values()} == {new.generation}


async def test_deregistration_removes_everything(control_plane: RedisControlPlane) -> None:
    engine = await _ready_engine(control_plane, "leaves")
    await control_plane.deregister("leaves", engine.generation)
    assert await control_plane.get_engine("leaves") is None
    assert await control_plane.list_engines() == []
    keys = await control_plane.connection.client.keys(f"{control_plane.keys.prefix}:*")
    assert sorted(k.decode() for k in keys) == [control_plane.keys.generation_counter("leaves")]


async def test_a_worker_republishing_its_rank_is_accepted(control_plane: RedisControlPlane) -> None:
    engine = await _ready_engine(control_plane, "repub")
    record = synthetic_records(engine)[(0, 0)]
    status = await control_plane.publish_handshakes(engine, [replace(record, num_blocks=512)])
    assert status is not None and status.state is EngineState.READY
    topology = await control_plane.get_topology("repub")
    assert topology.records[(0, 0)].num_blocks == 512


async def test_a_second_worker_claiming_a_held_rank_is_refused(
    control_plane: RedisControlPlane,
) -> None:
    engine = await _ready_engine(control_plane, "dup")
    impostor = replace(synthetic_records(engine)[(1, 0)], worker_id="impostor")
    with pytest.raises(DuplicateRankError, match="already held"):
        await control_plane.publish_handshakes(engine, [impostor])
    assert (await control_plane.get_topology("dup")).records[(1, 0)].worker_id != "impostor"


async def test_not_pp_aware_engine_is_refused_pp_above_zero(
    control_plane: RedisControlPlane, metrics: ControlPlaneMetrics
) -> None:
    with pytest.raises(PipelineParallelUnsupported, match="not PP-aware"):
        await control_plane.register(synthetic_spec("legacy", pp_size=2, pp_aware=False))
    engine = await control_plane.register(synthetic_spec("legacy", pp_size=1, pp_aware=False))
    stray = replace(synthetic_records(engine)[(0, 0)], pp_rank=1)
    with pytest.raises(PipelineParallelUnsupported, match=r"pp_rank > 0"):
        await control_plane.publish_handshakes(engine, [stray])
    assert (
        counter_value(
            metrics, "pdserve_control_plane_records_rejected_total", reason="not_pp_aware"
        )
        >= 1
    )


async def test_a_record_with_the_wrong_hash_is_refused_at_publication(
    control_plane: RedisControlPlane, metrics: ControlPlaneMetrics
) -> None:
    engine = await control_plane.register(synthetic_spec("h", pp_size=1, tp_size=1))
    bad = replace(synthetic_records(engine)[(0, 0)], compat_hash="f" * 32)
    with pytest.raises(HandshakeRejected, match="hash_mismatch"):
        await control_plane.publish_handshakes(engine, [bad])
    assert (
        counter_value(
            metrics, "pdserve_control_plane_records_rejected_total", reason="hash_mismatch"
        )
        == 1
    )


async def test_withdrawing_a_rank_turns_the_engine_pending(
    control_plane: RedisControlPlane,
) -> None:
    engine = await _ready_engine(control_plane, "w")
    record = synthetic_records(engine)[(1, 1)]
    await control_plane.withdraw_handshake(engine, 1, 1, record.worker_id)
    view = await control_plane.get_engine("w")
    assert view is not None and view.state is EngineState.PENDING
    inspection = await control_plane.inspect("w")
    assert inspection is not None and inspection.aggregation is not None
    assert inspection.aggregation.missing == ((1, 1),)


def _publish_stage(
    settings_json: str,
    engine_bytes: bytes,
    pp: int,
    go: multiprocessing.synchronize.Event,
    results: multiprocessing.Queue[str],
) -> None:
    """One process per PP stage; each TP rank of the stage publishes through its own client."""

    async def main() -> None:
        settings = ControlPlaneSettings.model_validate_json(settings_json)
        engine = decode(engine_bytes, EngineRecord)
        records = synthetic_records(engine)
        clients = [
            RedisControlPlane(settings, ControlPlaneMetrics()) for _ in range(engine.shape.tp_size)
        ]
        try:
            for client in clients:
                await client.connection.client.ping()
            await asyncio.to_thread(go.wait, 60)
            statuses = await asyncio.gather(
                *(c.publish_handshakes(engine, [records[(pp, tp)]]) for tp, c in enumerate(clients))
            )
            for status in statuses:
                results.put("none" if status is None else status.state.value)
        finally:
            for client in clients:
                await client.close()

    asyncio.run(main())


@pytest.mark.slow
async def test_an_8x8_grid_published_concurrently_from_separate_processes_yields_one_ready(
    control_plane: RedisControlPlane, cp_settings: ControlPlaneSettings
) -> None:
    engine = await control_plane.register(
        synthetic_spec("big", pp_size=8, tp_size=8, num_layers=32, num_kv_heads=8)
    )

    async def heartbeat() -> None:  # the engine host keeps its lease while workers start
        while True:
            await control_plane.heartbeat("big", engine.generation)
            await asyncio.sleep(1.0)

    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[str] = context.Queue()
    go = context.Event()
    beating = asyncio.create_task(heartbeat())
    try:
        async with control_plane.watch() as watcher:
            processes = [
                context.Process(
                    target=_publish_stage,
                    args=(cp_settings.model_dump_json(), encode(engine), pp, go, results),
                )
                for pp in range(8)
            ]
            for process in processes:
                process.start()
            await asyncio.sleep(0.5)
            go.set()
            for process in processes:
                await asyncio.to_thread(process.join, 120)
                assert process.exitcode == 0
            outcomes = [results.get(timeout=5) for _ in range(64)]
            assert outcomes.count("ready") == 1
            assert outcomes.count("none") == 63
            changes = []
            while True:  # every change since the watcher started, until quiet for 1 s
                try:
                    changes.append(await watcher.next_change(1.0))
                except TimeoutError:
                    break
            readies = [c for c in changes if c.became_ready]
            assert len(readies) == 1, "READY must be announced exactly once"
            assert readies[0].after is not None
            assert readies[0].after.generation == engine.generation
        topology = await control_plane.get_topology("big")
        assert len(topology.records) == 64
    finally:
        beating.cancel()


async def test_watcher_sees_ready_once_and_generation_changes(
    control_plane: RedisControlPlane,
) -> None:
    async with control_plane.watch() as watcher:
        engine = await _ready_engine(control_plane, "watched")
        view = await watcher.wait_for("watched", EngineState.READY, within_s=5)
        assert view.generation == engine.generation
        again = await control_plane.register(synthetic_spec("watched", pp_size=2, tp_size=2))
        view = await watcher.wait_for("watched", EngineState.PENDING, within_s=5)
        assert view.generation == again.generation


async def test_namespaces_do_not_see_each_other(cp_settings: ControlPlaneSettings) -> None:
    other = RedisControlPlane(
        cp_settings.model_copy(update={"namespace": f"other{uuid.uuid4().hex[:6]}"}),
        ControlPlaneMetrics(),
    )
    mine = RedisControlPlane(cp_settings, ControlPlaneMetrics())
    try:
        await _ready_engine(mine, "e1")
        assert await other.list_engines() == []
    finally:
        await other.close()
        await mine.close()


async def test_handshake_progress_is_reported_only_to_watchers_that_ask(
    control_plane: RedisControlPlane,
) -> None:
    engine = await control_plane.register(synthetic_spec("grid", pp_size=1, tp_size=4))
    records = list(synthetic_records(engine).values())
    async with (
        control_plane.watch() as verdicts,
        control_plane.watch(handshake_progress=True) as progress,
    ):
        initial = await progress.next_change(2.0)
        assert initial.before is None  # the initial sync
        for record in records[:3]:  # one at a time: a burst is reported once
            await control_plane.publish_handshakes(engine, [record])
            change = await progress.next_change(2.0)
            assert change.after is not None and change.after.state is EngineState.PENDING
        with pytest.raises(TimeoutError):  # nothing changed in any view: nothing to report
            while True:
                change = await verdicts.next_change(0.5)
                assert change.before is None, "only the initial sync may report"
        await control_plane.publish_handshakes(engine, [records[3]])
        view = await verdicts.wait_for("grid", EngineState.READY, within_s=5)
        assert view.generation == engine.generation


async def test_heartbeat_restores_an_engine_pruned_from_the_index_by_a_racing_reader(
    control_plane: RedisControlPlane,
) -> None:
    engine = await _ready_engine(control_plane, "raced")
    # A reader saw an older, expired registration and pruned the id just as this one started.
    await control_plane.connection.client.zrem(control_plane.keys.engines, "raced")
    assert await control_plane.list_engines() == []
    await control_plane.heartbeat("raced", engine.generation)
    assert [v.engine_id for v in await control_plane.list_engines()] == ["raced"]


async def test_pruning_keeps_an_engine_that_registered_again_after_it_was_read_expired(
    control_plane: RedisControlPlane,
) -> None:
    # list_engines read both ids expired; "back" registered again before the prune ran.
    await _ready_engine(control_plane, "back")
    client = control_plane.connection.client
    await client.zadd(control_plane.keys.engines, {"gone": 0})
    assert await control_plane._prune(["back", "gone"]) == ["gone"]
    assert await client.zrange(control_plane.keys.engines, 0, -1) == [b"back"]
    assert [v.engine_id for v in await control_plane.list_engines()] == ["back"]


async def _expire(cp: RedisControlPlane, engine: EngineRecord) -> None:
    """What a lease running out does to the engine's keys (without waiting for the TTL)."""
    await cp.connection.client.delete(*cp.keys.lease_keys(engine.engine_id, engine.generation))


async def test_a_registration_whose_lease_ran_out_is_restored_under_its_generation(
    control_plane: RedisControlPlane,
) -> None:
    spec = synthetic_spec("restored", pp_size=2, tp_size=1)
    engine = await control_plane.register(spec)
    await _expire(control_plane, engine)
    with pytest.raises(EngineNotFound):
        await control_plane.heartbeat("restored", engine.generation)

    restored = await control_plane.restore(spec, engine.generation)
    assert restored.generation == engine.generation
    view = await control_plane.get_engine("restored")
    assert view is not None and view.generation == engine.generation
    assert view.state is EngineState.PENDING
    await control_plane.heartbeat("restored", engine.generation)  # the lease lives again
    # Ranks started with the generation publish into it and the engine turns READY.
    status = await control_plane.publish_handshakes(
        restored, list(synthetic_records(restored).values())
    )
    assert status is not None and status.state is EngineState.READY


async def test_a_generation_superseded_since_cannot_be_restored(
    control_plane: RedisControlPlane,
) -> None:
    spec = synthetic_spec("taken", pp_size=1, tp_size=1)
    old = await control_plane.register(spec)
    await _expire(control_plane, old)
    newer = await control_plane.register(spec)  # another host took the engine id meanwhile
    await control_plane.deregister("taken", newer.generation)
    with pytest.raises(StaleGenerationError):
        await control_plane.restore(spec, old.generation)
    assert await control_plane.get_engine("taken") is None
