"""The reference engine's KV events end to end: an engine host (real gRPC server, real Redis
control plane, real rank processes: PP=2, whose host process alone publishes) registers its
event endpoints in its record; a ZMQ subscriber of those endpoints receives BlockStored for a
prompt's full blocks, once, and BlockRemoved when a small cache evicts them, with sequence
numbers from 0 (the replay endpoint fills what the subscriber joined too late to see)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.wire import EngineRole
from services.engines.reference.backend import ReferenceBackend
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.prefix_cache import block_keys
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import DecodeRequest, SamplingParams
from services.kv_events.events import BlockRemoved, BlockStored
from tests.integration.kv_event_client import EventClient, has
from tests.integration.services.conftest import hosted, service_settings

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kv-events-tiny"), seed=0)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


async def generate(backend: ReferenceBackend, request_id: str, prompt: list[int]) -> None:
    request = DecodeRequest(request_id, tuple(prompt), SamplingParams(max_tokens=2))
    async for _ in backend.decode(request):
        pass


async def test_a_hosted_reference_engine_publishes_its_prefix_cache_at_its_records_endpoints(
    cp_settings: ControlPlaneSettings,
    tiny_model: Path,
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # 8 blocks of 4: a 13-token prompt with 2 new tokens takes 4 and leaves its 3 full prompt
    # blocks cached; the third such prompt must evict.
    backend = ReferenceBackend(
        ReferenceEngineOptions(
            model_dir=tiny_model, pp_size=2, num_kv_blocks=8, block_size=BLOCK_SIZE
        )
    )  # PP=2: the host process publishes once for both stages
    settings = service_settings(cp_settings, ready_timeout_s=60.0)
    async with hosted(settings, backend, engine_id="kv-events-0", role=EngineRole.DECODE):
        control_plane = RedisControlPlane(cp_settings)
        try:
            view = await control_plane.get_engine("kv-events-0")
        finally:
            await control_plane.close()
        assert view is not None and view.record is not None
        record = view.record
        publisher = backend.kv_event_publisher
        assert publisher is not None
        events_port = publisher.endpoints.events.rpartition(":")[2]
        replay_port = publisher.endpoints.replay.rpartition(":")[2]
        # Bound on every interface, advertised at the host's gRPC host.
        assert record.kv_events_endpoint == f"tcp://127.0.0.1:{events_port}"
        assert record.kv_events_replay_endpoint == f"tcp://127.0.0.1:{replay_port}"

        subscriber = EventClient(zmq_context, record)
        try:
            prompts = [list(range(base, base + 13)) for base in (10, 40, 70)]
            keys = [block_keys(prompt, BLOCK_SIZE, len(prompt)) for prompt in prompts]

            await generate(backend, "first", prompts[0])
            await asyncio.to_thread(subscriber.receive_until, has(BlockStored, 1))
            stored = [e for e in subscriber.events() if isinstance(e, BlockStored)]
            assert stored == [BlockStored(tuple(keys[0]), None, tuple(prompts[0][:12]), BLOCK_SIZE)]
            assert min(subscriber.batches) == 0

            await generate(backend, "second", prompts[1])
            await generate(backend, "third", prompts[2])  # 6 cached + 4 needed > 8: 2 evicted
            await asyncio.to_thread(
                subscriber.receive_until,
                lambda events: (
                    any(isinstance(e, BlockRemoved) for e in events)
                    and len([e for e in events if isinstance(e, BlockStored)]) == 3
                ),
            )
            removed = [e for e in subscriber.events() if isinstance(e, BlockRemoved)]
            # The least recently used blocks go first, a prompt's tail before its head (as
            # vLLM): the first prompt's last two, so its first block is still a hit.
            assert removed == [BlockRemoved((keys[0][2], keys[0][1]))]
            stored = [e for e in subscriber.events() if isinstance(e, BlockStored)]
            assert [e.block_hashes for e in stored] == [tuple(k) for k in keys]
            assert sorted(subscriber.batches) == list(range(len(subscriber.batches)))
            assert subscriber.live, "nothing came over the PUB socket"
            # The heartbeat's cached keys and the events name the same blocks.
            assert set(backend.load().cached_block_hashes) == {keys[0][0], *keys[1], *keys[2]}
            # ...and the heartbeat names the last batch published (the router's silence check).
            assert backend.load().kv_events_seq == max(subscriber.batches)
        finally:
            subscriber.close()
