"""Reference engines for the integration tests: real rank processes, real Redis, real NIXL.

:func:`running_engine` builds a :class:`ReferenceBackend` and runs it through
:func:`~services.engines.standalone.registered_engine` (registered, heartbeated, started and
READY as the engine service would have it; stopped and deregistered afterwards). Their ranks are
forked, as an engine host forks them (tests/forked_engines.py); engines are still slow to start
on two cores (about a second per rank), so test modules share them through module-scoped
fixtures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole
from services.engines.reference.backend import ReferenceBackend
from services.engines.reference.batch import SequenceChunk
from services.engines.reference.options import ReferenceEngineOptions
from services.engines.reference.sampling import make_generator, sample_token, token_generator
from services.engines.reference.tiny_model import make_tiny_model
from services.engines.requests import DecodeRequest, SamplingParams, TokenDelta
from services.topology import EngineLayout
from tests.forked_engines import registered_forking
from tests.local_shard_group import LocalShardGroup

BLOCK_SIZE = 4
READY_TIMEOUT_S = 60.0
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. A serving system",
    "Hello, world! How are you today?",
    "Pipeline parallelism gives each stage a range of layers",
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("engine-tiny"), seed=0)


@pytest.fixture(scope="module")
def module_cp_settings(redis_server: LocalRedisServer) -> ControlPlaneSettings:
    """A namespace per test module (engines outlive single tests)."""
    return ControlPlaneSettings(
        redis=RedisSettings(url=redis_server.url, retry_attempts=3, retry_backoff_s=0.02),
        namespace=f"eng{uuid.uuid4().hex[:10]}",
        lease_ttl_s=10.0,
        heartbeat_interval_s=1.0,
        resync_interval_s=0.5,
    )


@contextlib.asynccontextmanager
async def running_engine(
    settings: ControlPlaneSettings,
    model_dir: Path,
    *,
    engine_id: str,
    role: EngineRole,
    pp: int = 1,
    tp: int = 1,
    partition: tuple[int, ...] | None = None,
    **options: object,
) -> AsyncIterator[ReferenceBackend]:
    """A started, READY reference engine (see the module docstring)."""
    values: dict[str, object] = {
        "num_kv_blocks": 64,
        "block_size": BLOCK_SIZE,
        "start_method": "fork",  # as engine hosts do: tests/forked_engines.py
        **options,
    }
    backend = ReferenceBackend(
        ReferenceEngineOptions(
            model_dir=model_dir,
            pp_size=pp,
            tp_size=tp,
            layer_partition=partition,
            **values,  # type: ignore[arg-type]
        ),
        registry=CollectorRegistry(),
    )
    async with registered_forking(
        settings, backend, engine_id=engine_id, role=role, ready_timeout_s=READY_TIMEOUT_S
    ) as engine:
        yield engine


async def collect(
    backend: ReferenceBackend,
    request_id: str,
    prompt: Sequence[int],
    sampling: SamplingParams,
    **kwargs: object,
) -> tuple[list[int], list[TokenDelta]]:
    """Run a decode stream to its end: (token ids, deltas)."""
    deltas = [
        delta
        async for delta in backend.decode(
            DecodeRequest(request_id, tuple(prompt), sampling, **kwargs)  # type: ignore[arg-type]
        )
    ]
    return [t for d in deltas for t in d.token_ids], deltas


async def wait_until_free(backend: ReferenceBackend, timeout_s: float = 15.0) -> None:
    """Bounded wait for every KV block of ``backend`` to be free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = backend.load()
        if load.kv_blocks_free == load.kv_blocks_total and load.running_requests == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not back to free within {timeout_s} s: {load}")
        await asyncio.sleep(0.02)


def reference_tokens(model_dir: Path, prompt: Sequence[int], sampling: SamplingParams) -> list[int]:
    """What the unsharded model gives in one process: greedy, or sampled with the engine's
    own sampler and token ``i`` drawn from ``token_generator(seed, i)`` (``ignore_eos``
    assumed)."""
    layout = EngineLayout.uniform(7, 2, 1, 1)
    unseeded = make_generator(None)
    table = tuple(range(64))
    tokens: list[int] = []
    with LocalShardGroup(model_dir, layout, 64, BLOCK_SIZE) as group:
        logits = group.step([SequenceChunk(tuple(prompt), 0, table)])[0]
        while True:
            generator = (
                unseeded if sampling.seed is None else token_generator(sampling.seed, len(tokens))
            )
            tokens.append(sample_token(logits, sampling, generator))
            if len(tokens) == sampling.max_tokens:
                return tokens
            cached = len(prompt) + len(tokens) - 1
            with torch.no_grad():
                logits = group.step([SequenceChunk((tokens[-1],), cached, table)])[0]
