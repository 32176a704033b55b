"""A fake engine connector for unit tests of the router's scheduling and HTTP layer.

Real engines are exercised by the integration and e2e tests; this one is a scripted stand-in:
instant, deterministic tokens, and failures on demand. The router app over it is the real one
(vLLM's front end) reading the synthetic checkpoint (:func:`checkpoint`): token id ``i`` below
256 is that byte, 256 and 257 are ``<s>`` and ``</s>``, and from 258 on id ``i`` reads
``" t<i>"``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from services.control_plane.base import EngineView
from services.control_plane.wire import (
    EngineLoad,
    EngineRecord,
    EngineRole,
    EngineState,
    EngineStatus,
)
from services.engines.errors import KVTransferFailed
from services.engines.lora import LoRAAdapter
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    FirstToken,
    KVHandle,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    Usage,
)
from services.engines.trace_context import TraceContext
from services.router.config import RouterSettings
from services.router.main import create_app
from services.router.metrics import RouterMetrics
from services.router.runtime import RouterRuntime
from services.router.scheduling.connector import ConnectorFactory
from services.serving.client.connector import EngineConnector
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from services.topology import ModelShape

MODEL = "tiny"
"""The model every fake engine registers (:func:`view`) and the app serves."""


def word(token_index: int) -> str:
    return f" w{token_index}"


@dataclass
class FakeEngine(EngineConnector):
    """Token ``i`` of every output is ``" w<i>"``; stop strings are honoured on whole words."""

    engine_id: str
    prefill_error: Exception | None = None
    decode_error: Exception | None = None
    fail_decode_after: int | None = None
    """Yield this many deltas, then one with FinishReason.ERROR."""
    truncate_after: int | None = None
    """Yield this many deltas, then end the stream without a finish reason."""
    stall_decode_after: int | None = None
    """Yield this many deltas, then wait forever: a stalled engine that is still reachable."""
    stall_prefill: bool = False
    """Prefill never answers (a stalled engine that is still reachable)."""
    delta_delay_s: float = 0.0
    """Wait this long before each delta (a slow but live engine)."""
    stalled_calls_closed: list[str] = field(default_factory=list)
    """Request ids whose stalled call the caller gave up on (cancelled or closed)."""
    cached_tokens: int = 0
    cache_write_tokens: int = 0
    first_output_id: int = 100
    """Token ``i`` (from the decode's first) has id ``first_output_id + i``."""
    prefills: list[str] = field(default_factory=list)
    decodes: list[DecodeRequest] = field(default_factory=list)
    once: list[str] = field(default_factory=list)
    """Request ids decoded with one unary call (``decode_once``, the ABC's default over
    :meth:`decode`, which records the call in ``decodes`` too)."""
    idle_bounds: list[float] = field(default_factory=list)
    """The ``idle_timeout_s`` of each ``decode_once``."""
    aborted: list[str] = field(default_factory=list)
    traces: list[tuple[str, str, TraceContext | None]] = field(default_factory=list)
    """``(call, request id, trace context)`` of every call (prefill, decode, abort)."""
    loras: list[tuple[str, str, LoRAAdapter | None]] = field(default_factory=list)
    """``(call, request id, LoRA adapter)`` of every prefill and decode."""
    lora_loads: list[tuple[LoRAAdapter, bool]] = field(default_factory=list)
    """``(adapter, load_inplace)`` of every ``load_lora``."""
    lora_load_error: Exception | None = None
    held_loras: tuple[str, ...] = ()
    closed: bool = False

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
        lora: LoRAAdapter | None = None,
    ) -> PrefillResult:
        self.prefills.append(request_id)
        self.loras.append(("prefill", request_id, lora))
        self.traces.append(("prefill", request_id, trace))
        if self.prefill_error is not None:
            raise self.prefill_error
        if self.stall_prefill:
            await self._stall(request_id)
        usage = Usage(len(prompt_token_ids), 1, self.cached_tokens, self.cache_write_tokens)
        finished = sampling.max_tokens == 1
        handle = (
            None
            if finished
            else KVHandle(
                self.engine_id, 1, request_id, (0, 1), len(prompt_token_ids), time.time() + 30
            )
        )
        more = tuple(
            FirstToken(7, word(0), FinishReason.LENGTH if finished else None)
            for _ in range(sampling.n - 1)
        )
        return PrefillResult(
            request_id=request_id,
            first_token_id=7,
            text=word(0),
            kv_handle=handle,
            finish_reason=FinishReason.LENGTH if finished else None,
            usage=usage,
            more_choices=more,
        )

    async def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        self.decodes.append(request)
        self.traces.append(("decode", request.request_id, request.trace))
        self.loras.append(("decode", request.request_id, request.lora))
        if self.decode_error is not None:
            raise self.decode_error
        if request.forks:  # one sequence per fork, interleaved, each tagged with its choice
            streams = [self._sequence(request, 1) for _ in request.forks]
            live = list(zip(request.forks, streams, strict=True))
            while live:
                for fork, stream in list(live):
                    delta = await anext(stream, None)
                    if delta is None:
                        live.remove((fork, stream))
                        continue
                    yield replace(delta, choice=fork.choice)
                    if delta.finish_reason is not None:
                        live.remove((fork, stream))
            return
        async for delta in self._sequence(request, 1 if request.kv_handle is not None else 0):
            yield delta

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        self.once.append(request.request_id)
        self.idle_bounds.append(idle_timeout_s)
        return await super().decode_once(
            request, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s
        )

    async def _sequence(self, request: DecodeRequest, start: int) -> AsyncIterator[TokenDelta]:
        text = "".join(word(i) for i in range(start))
        total = request.sampling.max_tokens
        for index in range(start, total):
            produced = index - start
            if self.fail_decode_after is not None and produced == self.fail_decode_after:
                yield TokenDelta((), "", FinishReason.ERROR, error="rank 0 died")
                return
            if self.truncate_after is not None and produced == self.truncate_after:
                return
            if self.stall_decode_after is not None and produced == self.stall_decode_after:
                await self._stall(request.request_id)
            if self.delta_delay_s:
                await asyncio.sleep(self.delta_delay_s)
            piece = word(index)
            text += piece
            stop = next((s for s in request.sampling.stop if s in text), None)
            last = index == total - 1 or stop is not None
            if stop is not None:
                piece = piece[: len(piece) - (len(text) - text.index(stop))]
            usage = (
                Usage(
                    len(request.prompt_token_ids),
                    index + 1,
                    self.cached_tokens,
                    self.cache_write_tokens,
                )
                if last
                else None
            )
            finish = (FinishReason.STOP if stop else FinishReason.LENGTH) if last else None
            yield TokenDelta(
                (self.first_output_id + index,),
                piece,
                finish,
                usage=usage,
                kv_transfer_s=0.001 if produced == 0 and start else None,
            )
            if last:
                return

    async def _stall(self, request_id: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            self.stalled_calls_closed.append(request_id)

    async def abort(self, request_id: str, *, trace: TraceContext | None = None) -> bool:
        self.aborted.append(request_id)
        self.traces.append(("abort", request_id, trace))
        return True

    async def load_lora(
        self, adapter: LoRAAdapter, *, load_inplace: bool = False, timeout_s: float | None = None
    ) -> tuple[str, ...]:
        self.lora_loads.append((adapter, load_inplace))
        if self.lora_load_error is not None:
            raise self.lora_load_error
        self.held_loras = tuple(sorted({*self.held_loras, adapter.name}))
        return self.held_loras

    async def unload_lora(self, name: str, *, timeout_s: float | None = None) -> bool:
        found = name in self.held_loras
        self.held_loras = tuple(n for n in self.held_loras if n != name)
        return found

    async def close(self) -> None:
        self.closed = True


class BlamesProducer(FakeEngine):
    """A decode engine whose pulls from ``dead`` fail (the producer died with the KV)."""

    dead = "p1"

    async def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        if request.kv_handle is not None and request.kv_handle.producer_engine_id == self.dead:
            self.decodes.append(request)
            raise KVTransferFailed("the producer is gone", "remote_disconnected")
        async for delta in super().decode(request, timeout_s=timeout_s):
            yield delta


class FailsFirstLegs(FakeEngine):
    """Fails every first leg mid-stream (``fail_decode_after``), never a continuation."""

    async def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        if ".m" in request.request_id:
            self.fail_decode_after = None
        async for delta in super().decode(request, timeout_s=timeout_s):
            yield delta


class FakeFactory(ConnectorFactory):
    """Hands out the :class:`FakeEngine` registered for each engine id."""

    def __init__(self) -> None:
        self.engines: dict[str, FakeEngine] = {}

    def connect(self, record: EngineRecord) -> EngineConnector:
        return self.engines.setdefault(record.engine_id, FakeEngine(record.engine_id))


def view(
    engine_id: str,
    role: EngineRole,
    *,
    model: str = MODEL,
    compat_hash: str = "h1",
    block_size: int = 4,
    generation: int = 1,
    state: EngineState = EngineState.READY,
    load: EngineLoad | None = None,
    max_model_len: int = 0,
    engine_kind: str = "reference",
    kv_events_endpoint: str = "",
    kv_events_replay_endpoint: str = "",
    kv_block_bytes: int = 0,
) -> EngineView:
    record = EngineRecord(
        engine_id=engine_id,
        generation=generation,
        role=role,
        model=model,
        compat_hash=compat_hash,
        shape=ModelShape(
            num_layers=2, num_kv_heads=2, block_size=block_size, max_model_len=max_model_len
        ),
        endpoint=f"127.0.0.1:{9000 + len(engine_id)}",
        pp_aware=True,
        lease_ttl_ms=5000,
        registered_at_ms=0,
        engine_kind=engine_kind,
        kv_events_endpoint=kv_events_endpoint,
        kv_events_replay_endpoint=kv_events_replay_endpoint,
        kv_block_bytes=kv_block_bytes,
    )
    status = EngineStatus(engine_id, generation, state, (), 1, 0)
    return EngineView(engine_id, record, status, load or EngineLoad())


@functools.cache
def checkpoint() -> Path:
    """The synthetic checkpoint (32,000 ids, 4,096 tokens of context) the app reads, written
    once per process."""
    root = Path(tempfile.mkdtemp(prefix="pdserve-fakes-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return write_synthetic_checkpoint(root / MODEL, vocab_size=32_000, max_model_len=4096)


def text_of(*token_ids: int) -> str:
    """The text of ``token_ids`` in the synthetic checkpoint's tokenizer: what vLLM's front end
    answers for them (it detokenizes the engines' ids, not their text)."""
    tokenizer = Tokenizer.from_file(str(checkpoint() / "tokenizer.json"))
    return str(tokenizer.decode(list(token_ids)))


def runtime(factory: FakeFactory | None = None, **overrides: object) -> RouterRuntime:
    settings = RouterSettings.model_validate(
        {"policy": "least_loaded", "tokenizer": checkpoint(), **overrides}
    )
    return RouterRuntime.build(
        settings, factory or FakeFactory(), RouterMetrics(CollectorRegistry())
    )


def sample(rt: RouterRuntime, name: str, **labels: str) -> float:
    value = rt.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def outcomes(rt: RouterRuntime, endpoint: str = "/v1/completions") -> dict[str, float]:
    """``pdserve_router_requests_total`` of ``endpoint`` by outcome (those counted)."""
    return {
        metric.labels["outcome"]: metric.value
        for family in rt.metrics.registry.collect()
        for metric in family.samples
        if metric.name == "pdserve_router_requests_total" and metric.labels["endpoint"] == endpoint
    }


def prepared(
    factory: FakeFactory, *engines: tuple[str, EngineRole], **settings: object
) -> RouterRuntime:
    """A runtime whose pool holds ``engines`` (READY) and counts as synced."""
    rt = runtime(factory, **settings)
    for engine_id, role in engines:
        rt.pool.update(engine_id, view(engine_id, role))
    rt.pool._synced.set()
    return rt


@contextlib.asynccontextmanager
async def http(rt: RouterRuntime) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the router app in-process (httpx's ASGI transport), the app's lifespan
    run around it (vLLM's front end builds its serving state there; httpx's transport runs
    none)."""
    app = create_app(rt.settings, runtime=rt)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield client


async def post_then_hang_up(
    app: Any,
    body: dict[str, Any],
    hang_up: asyncio.Event,
    *,
    bound_s: float,
    lifespan: bool = False,
) -> list[dict[str, Any]]:
    """POST ``body`` to ``app``'s /v1/completions as raw ASGI, so that the test decides when
    the client's ``http.disconnect`` arrives: once ``hang_up`` is set. With ``lifespan``, the
    app's lifespan runs around the call (vLLM's front end builds its state there). Returns
    what the app sent."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"router"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    async with contextlib.AsyncExitStack() as stack:
        if lifespan:
            await stack.enter_async_context(app.router.lifespan_context(app))
        await asyncio.wait_for(app(scope, receive, send), bound_s)
    return sent
