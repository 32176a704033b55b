"""pdserve's vLLM connector against vLLM 0.32.0's real classes on CPU, with a real Redis.

The scheduler side is driven through vLLM's own entry points: EngineCore's call
``set_xfer_handshake_metadata_pp_aware``, and ``Scheduler.schedule`` / ``request_finished``
with real ``Request`` and ``SchedulerOutput`` objects. The worker side's resolution reads the
published records back. NIXL agents and GPU memory are not involved: the payloads are vLLM's own
classes filled with the geometry a GPU worker would register.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.base import EngineSpec
from services.control_plane.wire import EngineRole, EngineState
from services.engines.vllm.handshake import (
    ConnectorSettings,
    ControlPlaneBridge,
    HandshakeResolutionError,
    VllmHandshakeExtra,
    vllm_engine_id,
)
from services.engines.vllm.layouts import TransferMode, UnsupportedVllmLayout
from services.topology import ModelShape

# vLLM 0.32.0 and torch 2.13.0 warn about their own internals on import; nothing of ours.
VLLM_IMPORT_WARNINGS = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:torch"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:vllm"),
    pytest.mark.filterwarnings("ignore::FutureWarning:vllm"),
]
pytestmark = [pytest.mark.integration, *VLLM_IMPORT_WARNINGS]

NUM_LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 7, 2, 64, 16


def spec(engine_id: str, pp: int, tp: int, role: EngineRole = EngineRole.PREFILL) -> EngineSpec:
    return EngineSpec(
        engine_id=engine_id,
        role=role,
        model="tiny",
        compat_hash="c0ffee",
        shape=ModelShape(
            num_layers=NUM_LAYERS, num_kv_heads=KV_HEADS, block_size=BLOCK, pp_size=pp, tp_size=tp
        ),
        endpoint="127.0.0.1:1",
        engine_kind="vllm",
    )


def nixl_payloads(vid: str, pp: int, tp: int) -> dict[tuple[int, int], Any]:
    """What vLLM's GPU workers hand EngineCore: a NixlHandshakePayload per (pp, tp)."""
    import msgspec  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: PLC0415
        NixlAgentMetadata,
        NixlHandshakePayload,
    )
    from vllm.distributed.utils import get_pp_indices  # noqa: PLC0415

    block_len = (KV_HEADS // tp) * BLOCK * HEAD_SIZE * 4
    payloads = {}
    for p in range(pp):
        start, end = get_pp_indices(NUM_LAYERS, p, pp)
        regions = 2 * (end - start)
        meta = NixlAgentMetadata(
            engine_id=vid,
            agent_metadata=f"agent-{p}".encode(),
            kv_caches_base_addr=[0x1000_0000 * (i + 1) for i in range(regions)],
            device_id=0,
            num_blocks=64,
            block_lens=[block_len] * regions,
            block_strides=[block_len] * regions,
            kv_cache_layout="LBHNC",
            block_size=BLOCK,
            ssm_sizes=(0, 0),
            attn_backend_name="FLASH_ATTN",
            physical_blocks_per_logical_kv_block=1,
        )
        for t in range(tp):
            payloads[(p, t)] = NixlHandshakePayload(
                compatibility_hash="vllm-hash", agent_metadata_bytes=msgspec.msgpack.encode(meta)
            )
    return payloads


def settings_for(cp: ControlPlaneSettings, engine_id: str, generation: int) -> dict[str, Any]:
    return ConnectorSettings(engine_id, generation, cp, TransferMode.PUSH).to_extra_config()


async def scheduler_connector(
    control_plane: RedisControlPlane,
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
    engine_id: str,
    *,
    pp: int,
    tp: int,
) -> tuple[Any, str]:
    """A registered prefill and its push connector in vLLM's scheduler role, with its vLLM id."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        KVConnectorRole,
    )

    from services.engines.vllm.connector import PdservePushConnector  # noqa: PLC0415

    engine = await control_plane.register(spec(engine_id, pp, tp))
    vid = vllm_engine_id(engine_id, engine.generation)
    config = make_vllm_config(
        pp=pp,
        tp=tp,
        role="kv_producer",
        engine_id=vid,
        extra=settings_for(cp_settings, engine_id, engine.generation),
    )
    return PdservePushConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config), vid


async def test_scheduler_publishes_pp_tp_grid_and_engine_turns_ready(
    control_plane: RedisControlPlane,
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
) -> None:
    from vllm.distributed.utils import get_pp_indices  # noqa: PLC0415

    connector, vid = await scheduler_connector(
        control_plane, cp_settings, make_vllm_config, kv_cache_config, "pre", pp=2, tp=2
    )
    try:
        # vLLM's EngineCore runs this on its own thread; so do we (it blocks on Redis).
        payloads = nixl_payloads(vid, 2, 2)
        await asyncio.to_thread(connector.set_xfer_handshake_metadata_pp_aware, payloads)
        topology = await control_plane.get_topology("pre")
        assert sorted(topology.records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for (pp, tp), record in topology.records.items():
            assert (record.layers.start, record.layers.stop) == get_pp_indices(NUM_LAYERS, pp, 2)
            assert (record.kv_heads.start, record.kv_heads.stop) == (tp, tp + 1)
            extra = VllmHandshakeExtra.decode(record.extra)
            assert extra.transfer_mode is TransferMode.PUSH
            assert extra.nixl_payload  # vLLM's payload, byte for byte re-encoded
        # vLLM re-publishes (e.g. after a KV-cache re-initialisation): same grid, still READY.
        await asyncio.to_thread(connector.set_xfer_handshake_metadata_pp_aware, payloads)
        view = await control_plane.get_engine("pre")
        assert view is not None and view.state is EngineState.READY
        assert connector.connector_scheduler.publications == 2
        assert connector.connector_scheduler.side_channel_port == 0  # no ZMQ listener
        assert connector.connector_scheduler._nixl_handshake_listener_t is None
    finally:
        await asyncio.to_thread(connector.shutdown)


async def test_incomplete_grid_is_refused_before_publication(
    control_plane: RedisControlPlane,
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
) -> None:
    connector, vid = await scheduler_connector(
        control_plane, cp_settings, make_vllm_config, kv_cache_config, "half", pp=2, tp=1
    )
    try:
        payloads = nixl_payloads(vid, 2, 1)
        del payloads[(1, 0)]
        with pytest.raises(UnsupportedVllmLayout, match="full"):
            await asyncio.to_thread(connector.set_xfer_handshake_metadata_pp_aware, payloads)
        view = await control_plane.get_engine("half")
        assert view is not None and view.state is EngineState.PENDING
    finally:
        await asyncio.to_thread(connector.shutdown)


async def test_worker_resolution_reads_published_grid_and_fences_old_generations(
    control_plane: RedisControlPlane,
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
) -> None:
    connector, vid = await scheduler_connector(
        control_plane, cp_settings, make_vllm_config, kv_cache_config, "p2", pp=2, tp=1
    )
    try:
        await asyncio.to_thread(
            connector.set_xfer_handshake_metadata_pp_aware, nixl_payloads(vid, 2, 1)
        )
    finally:
        await asyncio.to_thread(connector.shutdown)

    bridge = await asyncio.to_thread(ControlPlaneBridge, cp_settings, timeout_s=5.0)

    async def resolve(tp: int = 1, mode: TransferMode = TransferMode.PUSH) -> dict[Any, Any]:
        return await asyncio.to_thread(
            bridge.resolve,
            vid,
            remote_pp_size=2,
            remote_tp_size=tp,
            tp_ranks=[0],
            expected_mode=mode,
        )

    try:
        extras = await resolve()
        assert sorted(extras) == [(0, 0), (1, 0)]
        with pytest.raises(HandshakeResolutionError, match="TP=2"):
            await resolve(tp=2)
        # A pull-mode worker must not handshake with a push-mode prefill.
        with pytest.raises(HandshakeResolutionError, match="push and pull"):
            await resolve(mode=TransferMode.PULL)
        # The prefill restarts: its old vLLM engine id must never resolve again.
        await control_plane.register(spec("p2", 2, 1))
        with pytest.raises(HandshakeResolutionError):
            await resolve()
    finally:
        await asyncio.to_thread(bridge.close)


@pytest.mark.parametrize(
    ("pp", "role", "connector", "match"),
    [
        (2, "kv_consumer", "PdservePushConnector", "needs pull mode"),
        (2, "kv_both", "PdservePushConnector", "needs pull mode"),
    ],
)
def test_unsupported_layouts_are_rejected_at_construction(
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
    pp: int,
    role: str,
    connector: str,
    match: str,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
        KVConnectorRole,
    )

    from services.engines.vllm import connector as module  # noqa: PLC0415

    mode = TransferMode.PULL if connector == "PdservePullConnector" else TransferMode.PUSH
    extra = ConnectorSettings("bad", 1, cp_settings, mode).to_extra_config()
    config = make_vllm_config(
        pp=pp, tp=1, role=role, engine_id="bad.g1", extra=extra, connector=connector
    )
    with pytest.raises(UnsupportedVllmLayout, match=match):
        getattr(module, connector)(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_real_scheduler_hands_off_with_control_plane_params(
    cp_settings: ControlPlaneSettings,
    make_vllm_config: Any,
    kv_cache_config: Any,
) -> None:
    """vLLM's own Scheduler with our connector: a do_remote_decode request is prefilled, its
    blocks held for the consumer, and the kv_transfer_params name the generation-scoped engine
    id and the PP x TP layout (no side-channel host)."""
    from vllm.sampling_params import SamplingParams  # noqa: PLC0415
    from vllm.v1.core.sched.output import SchedulerOutput  # noqa: PLC0415
    from vllm.v1.core.sched.scheduler import Scheduler  # noqa: PLC0415
    from vllm.v1.request import Request, RequestStatus  # noqa: PLC0415
    from vllm.v1.structured_output import StructuredOutputManager  # noqa: PLC0415

    from services.engines.vllm._connector_common import CONTROL_PLANE_HOST  # noqa: PLC0415

    vid = vllm_engine_id("sched", 7)
    config = make_vllm_config(
        pp=2,
        tp=1,
        role="kv_producer",
        engine_id=vid,
        extra=settings_for(cp_settings, "sched", 7),
    )
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # EngineCore sets it
    config.cache_config.enable_prefix_caching = False  # requests here carry no block hasher
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    try:
        sampling = SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
        )
        request = Request("r1", list(range(40)), sampling, None)
        scheduler.add_request(request)
        output = scheduler.schedule()
        assert isinstance(output, SchedulerOutput)
        assert output.num_scheduled_tokens.get("r1", 0) > 0
        assert output.kv_connector_metadata is not None
        connector = scheduler.get_kv_connector()
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        block_ids = scheduler.kv_cache_manager.get_block_ids("r1")
        hold, params = connector.request_finished_all_groups(request, block_ids)
        assert hold is True and params is not None
        assert params["remote_engine_id"] == vid
        assert params["remote_host"] == CONTROL_PLANE_HOST
        assert (params["pp_size"], params["tp_size"]) == (2, 1)
        assert params["remote_block_ids"] and params["remote_block_ids"][0]
    finally:
        scheduler.shutdown()


def test_every_pp_tp_worker_reports_once_before_vllms_aggregator_finishes() -> None:
    """vLLM's real KVOutputAggregator over a PP=2 x TP=2 engine, fed through FinishedOnce: a
    request finishes only after all four workers (non-final PP ranks too) reported it, and a
    worker's repeated report cannot finish it early."""
    from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: PLC0415
        KVOutputAggregator,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: PLC0415

    from services.engines.vllm.contracts import FinishedOnce  # noqa: PLC0415

    aggregator = KVOutputAggregator(expected_finished_count=4)  # world size, as vLLM sets it
    ledgers = [FinishedOnce() for _ in range(4)]

    def step(reports: list[set[str]]) -> set[str]:
        outputs = []
        for ledger, sent in zip(ledgers, reports, strict=True):
            output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            output.kv_connector_output = KVConnectorOutput(
                finished_sending=ledger.filter("send", sent) or None
            )
            outputs.append(output)
        result = aggregator.aggregate(outputs)
        assert result is not None and result.kv_connector_output is not None
        return result.kv_connector_output.finished_sending or set()

    # Worker 0 (PP rank 0) reports twice; workers 1 and 2 once; worker 3 not yet.
    assert step([{"r"}, {"r"}, {"r"}, set()]) == set()
    assert step([{"r"}, set(), set(), set()]) == set()  # the duplicate is dropped, not counted
    assert step([set(), set(), set(), {"r"}]) == {"r"}
    assert ledgers[0].duplicates["send"] == 1


def test_pull_peers_at_the_shared_address_do_not_replace_each_other() -> None:
    """vLLM's pull worker releases every engine not serving some peer address; all pdserve peers
    share one fake address, so the worker keys vLLM's tracking by pdserve engine: another
    engine is kept, only an older generation of the same engine is replaced."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: PLC0415
        NixlPullConnectorWorker,
    )

    from services.engines.vllm._connector_common import CONTROL_PLANE_HOST  # noqa: PLC0415
    from services.engines.vllm._connector_worker import WorkerHandshake  # noqa: PLC0415

    class Tracker:  # the state vLLM's _track_remote_engine_replacement reads, nothing else
        _TRANSFER_MODE = NixlPullConnectorWorker._TRANSFER_MODE
        _track_remote_engine_replacement = NixlPullConnectorWorker._track_remote_engine_replacement

        def __init__(self) -> None:
            self._engine_by_address: dict[tuple[str, int], str] = {}

    class Worker(WorkerHandshake, Tracker):
        pass

    worker = Worker()
    for engine in ("pre-a.g1", "pre-b.g1", "pre-a.g2"):
        worker._track_remote_engine_replacement(engine, CONTROL_PLANE_HOST, 0)
    assert set(worker._engine_by_address.values()) == {"pre-a.g2", "pre-b.g1"}


def test_peer_invalidation_waits_for_vllms_main_thread(cp_settings: ControlPlaneSettings) -> None:
    """The watcher's callback (bridge thread) only queues a departed peer; vLLM's remote-engine
    state is changed when the main thread next asks for transfer results."""
    from services.engines.vllm._connector_worker import WorkerHandshake  # noqa: PLC0415
    from services.engines.vllm.layouts import KVRole, VllmLayout  # noqa: PLC0415

    class FakeNixlWorker:
        def __init__(self) -> None:
            self._remote_agents = {"pre.g1": {(0, 0): "agent"}}
            self.invalidated: list[str] = []

        def _mark_remote_engine_invalid(self, engine_id: str, now: float) -> None:
            self.invalidated.append(engine_id)

        def get_transfer_results(self) -> str:
            return "results"

    class Worker(WorkerHandshake, FakeNixlWorker):
        pass

    worker = Worker()
    settings = ConnectorSettings("dec", 1, cp_settings, TransferMode.PULL)
    worker._pdserve_init(settings, VllmLayout(KVRole.CONSUMER, TransferMode.PULL, 1, 1))
    worker._peer_generations["pre"] = "pre.g1"
    worker._on_peer_change(None, "pre")  # the prefill left the control plane
    assert worker.invalidated == []
    assert worker.get_transfer_results() == "results"
    assert worker.invalidated == ["pre.g1"]


def test_only_peers_of_the_same_model_and_geometry_are_pre_warmed(
    cp_settings: ControlPlaneSettings,
) -> None:
    """Engines of other models share a namespace: their handshakes would fail (counted as
    transfer failures), and the router never pairs them, so the worker leaves them alone."""
    from services.control_plane.base import EngineView  # noqa: PLC0415
    from services.control_plane.wire import EngineRecord, EngineRole  # noqa: PLC0415
    from services.engines.vllm._connector_worker import WorkerHandshake  # noqa: PLC0415
    from services.engines.vllm.layouts import KVRole, VllmLayout  # noqa: PLC0415

    def prefill(engine_id: str, compat_hash: str) -> EngineView:
        record = EngineRecord(
            engine_id=engine_id,
            generation=1,
            role=EngineRole.PREFILL,
            model="tiny",
            compat_hash=compat_hash,
            shape=ModelShape(num_layers=7, num_kv_heads=2, block_size=32, tp_size=2),
            endpoint="127.0.0.1:1",
            pp_aware=True,
            lease_ttl_ms=10_000,
            registered_at_ms=0,
            engine_kind="vllm",
        )
        return EngineView(engine_id, record, None, None)

    worker = WorkerHandshake()
    settings = ConnectorSettings("dec", 1, cp_settings, TransferMode.PULL, compat_hash="ours")
    worker._pdserve_init(settings, VllmLayout(KVRole.CONSUMER, TransferMode.PULL, 1, 1))
    same = worker._wanted_peer(prefill("pre-same", "ours"))
    assert same is not None and same[0].tp_size == 2
    assert worker._wanted_peer(prefill("pre-other-model", "theirs")) is None
