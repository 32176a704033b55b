"""``StubBackend``: an instant engine with deterministic tokens and no model (engine name "stub").

For the router's benchmark (``pdserve bench router`` puts the router in front of stub engines so
the figure is the router's own cost) and for tests of the host and servicers. It honours the
whole :class:`~services.engines.backend.EngineBackend` contract a caller can observe: it
registers and publishes a synthetic but consistent handshake grid (so it turns READY), validates
its inputs, admits up to ``num_kv_blocks`` worth of requests, streams, aborts, drains.

What it does not do: compute anything or move KV. A prefill returns a handle with real-looking
block ids but holds nothing (nobody could pull it); a decode with a handle trusts it. The grid,
handles, tokens and text are :class:`~services.engines.synthetic.SyntheticEngine`'s, shared with
the simulated engine (:mod:`services.engines.sim`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.control_plane.synthetic import synthetic_spec
from services.control_plane.wire import EngineLoad
from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineOverloaded,
    RequestAborted,
)
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    Usage,
)
from services.engines.synthetic import SyntheticClaim, SyntheticEngine
from services.topology import ModelShape

STUB_MODEL = "stub"


@dataclass(frozen=True)
class StubOptions:
    """The stub engine's shape and pace."""

    pp_size: int = 1
    tp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    num_layers: int = 4
    num_kv_heads: int = 4
    vocab_size: int = 32_000
    max_model_len: int = 4096
    num_kv_blocks: int = 4096
    block_size: int = 16
    kv_lease_s: float = 30.0
    token_delay_s: float = 0.0
    """Pause per generated token (and once per prefill): lets tests catch a request mid-way."""

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self)


@dataclass
class _Running:
    blocks: int
    aborted: asyncio.Event


class StubBackend(SyntheticEngine):
    """See the module docstring."""

    def __init__(self, options: StubOptions | None = None) -> None:
        self.options = options or StubOptions()
        spec = synthetic_spec(
            "stub",
            pp_size=self.options.pp_size,
            tp_size=self.options.tp_size,
            num_layers=self.options.num_layers,
            num_kv_heads=self.options.num_kv_heads,
            block_size=self.options.block_size,
        )
        super().__init__(
            SyntheticClaim(
                engine_kind="stub",
                model=STUB_MODEL,
                compat_hash=spec.compat_hash,
                shape=self.options.shape,
                num_kv_blocks=self.options.num_kv_blocks,
                kv_lease_s=self.options.kv_lease_s,
            )
        )
        self._running: dict[str, _Running] = {}
        self._free_blocks = self.options.num_kv_blocks

    def _admit(self, request_id: str, num_tokens: int) -> _Running:
        if self._draining:
            raise EngineDraining("the engine is draining and admits no new request")
        if request_id in self._running:
            raise DuplicateRequest(f"request {request_id} is already running")
        blocks = math.ceil(num_tokens / self.options.block_size)
        if blocks > self._free_blocks:
            raise EngineOverloaded(
                f"KV pool full: {blocks} blocks needed, {self._free_blocks} free"
            )
        self._free_blocks -= blocks
        running = _Running(blocks, asyncio.Event())
        self._running[request_id] = running
        self._idle.clear()
        return running

    def _release(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is not None:
            self._free_blocks += running.blocks
        if not self._running:
            self._idle.set()

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        request_id, prompt_token_ids, sampling = (
            request.request_id,
            request.prompt_token_ids,
            request.sampling,
        )
        start = time.monotonic()
        running = self._admit(request_id, len(prompt_token_ids))
        try:
            await asyncio.sleep(self.options.token_delay_s)
            token = self._first_token(prompt_token_ids)
            if running.aborted.is_set():
                raise RequestAborted(f"request {request_id} aborted before its first token")
            usage = Usage(prompt_tokens=len(prompt_token_ids), completion_tokens=1)
            finish = FinishReason.LENGTH if sampling.max_tokens == 1 else None
            if token in sampling.stop_token_ids:
                finish = FinishReason.STOP
            handle = None
            if finish is None:
                handle = self._hold(request_id, running.blocks, len(prompt_token_ids))
            return PrefillResult(
                request_id=request_id,
                first_token_id=token,
                text=self.detokenize([token]),
                kv_handle=handle,
                finish_reason=finish,
                usage=usage,
                prefill_s=time.monotonic() - start,
            )
        finally:
            self._release(request_id)

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        sampling = request.sampling
        prompt_len = len(request.prompt_token_ids)
        running = self._admit(request.request_id, prompt_len + sampling.max_tokens)
        try:
            if request.kv_handle is not None and request.first_token_id is not None:
                token = request.first_token_id
                generated = 1  # the producer's first token counts toward max_tokens
                first_delta_transfer_s: float | None = 0.0
            else:
                token = self._first_token(request.prompt_token_ids) - 1
                generated = 0
                first_delta_transfer_s = None
            while generated < sampling.max_tokens:
                await asyncio.sleep(self.options.token_delay_s)
                if running.aborted.is_set():
                    yield self._last(request, generated, FinishReason.ABORT)
                    return
                token = self._next_token(token)
                if token in sampling.stop_token_ids:
                    yield self._last(request, generated, FinishReason.STOP)
                    return
                generated += 1
                yield TokenDelta(
                    (token,), self.detokenize([token]), kv_transfer_s=first_delta_transfer_s
                )
                first_delta_transfer_s = None
            yield self._last(request, generated, FinishReason.LENGTH)
        finally:
            self._release(request.request_id)

    async def abort(self, request_id: str) -> bool:
        running = self._running.get(request_id)
        if running is not None:
            running.aborted.set()
            return True
        return self._drop_held(request_id)

    def load(self) -> EngineLoad:
        return EngineLoad(
            queue_depth=0,
            running_requests=len(self._running),
            kv_blocks_free=self._free_blocks,
            kv_blocks_total=self.options.num_kv_blocks,
        )

    def _in_flight(self) -> list[str]:
        return list(self._running)
