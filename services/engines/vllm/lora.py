"""The LoRA adapters of one vLLM engine: :class:`VllmAdapters`, pdserve's names over vLLM's ids.

vLLM knows an adapter by its ``lora_int_id`` (``LoRARequest``); pdserve's engines are told
names and paths (:class:`~services.engines.lora.LoRAAdapter`), by the router's load calls and
by every request. This engine gives each ``(name, path)`` an id of its own, the first time it
sees it: :meth:`VllmAdapters.request_for` loads an adapter it does not hold (``add_lora``,
which validates the folder and keeps the engine running when it is bad) before a request runs
with it, so a bad folder fails that one request instead of the engine step that would load
it. vLLM keeps at most ``max_cpu_loras`` adapters (its LRU evicts the least recently used);
which ones it holds is read back from vLLM (``list_loras``) after every load and every request
with an adapter, for the engine's load record (``EngineLoad.lora_adapters``).

Errors are vLLM's messages, translated once here: a folder vLLM finds nothing in is
:class:`~services.engines.errors.LoRAAdapterNotFound` (vLLM's ``LoRAAdapterNotFoundError``
text, which the router's front end answers with vLLM's 404), any other refusal (a rank above
``max_lora_rank``, modules of another model) :class:`~services.engines.errors.InvalidRequest`.
Imports vLLM inside the methods only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

from services.control_plane.wire import MAX_REPORTED_ADAPTERS
from services.engines.errors import InvalidRequest, LoRAAdapterNotFound, LoRANotServed
from services.engines.lora import LoRAAdapter

logger = logging.getLogger(__name__)


class VllmAdapters:
    """The adapters of one vLLM engine (``AsyncLLM``); see the module docstring."""

    def __init__(self, engine_id: str, max_loras: int) -> None:
        self.engine_id = engine_id
        self.max_loras = max_loras
        """vLLM's ``max_loras``; 0 when the engine was started without LoRA."""
        self._requests: dict[str, Any] = {}
        """Name -> vLLM's ``LoRARequest`` this engine loaded it as (its path and id)."""
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._held: tuple[str, ...] = ()
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def held(self) -> tuple[str, ...]:
        """The names vLLM held at the last read, sorted (at most
        :data:`~services.control_plane.wire.MAX_REPORTED_ADAPTERS`)."""
        return self._held

    def require_slots(self) -> None:
        """Raise :class:`LoRANotServed` when this engine runs no adapter."""
        if self.max_loras <= 0:
            raise LoRANotServed(
                f"engine {self.engine_id} (vllm) serves no LoRA adapter: it was started "
                "without --enable-lora"
            )

    async def request_for(self, engine: Any, adapter: LoRAAdapter) -> Any:
        """vLLM's ``LoRARequest`` for ``adapter``, loading it first when this engine has not
        loaded that name from that path."""
        self.require_slots()
        current = self._requests.get(adapter.name)
        if current is not None and current.lora_path == adapter.path:
            return current
        return await self.load(engine, adapter, replace=False)

    async def load(self, engine: Any, adapter: LoRAAdapter, *, replace: bool) -> Any:
        """Load ``adapter`` (again under a new id with ``replace``, or when its path changed);
        returns its ``LoRARequest``. An adapter loaded before under the name stays loaded
        until the new one is (a failed load changes nothing)."""
        self.require_slots()
        from vllm.exceptions import LoRAAdapterNotFoundError  # noqa: PLC0415 - lazy: vLLM
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        async with self._lock:
            current = self._requests.get(adapter.name)
            if current is not None and current.lora_path == adapter.path and not replace:
                return current
            request = LoRARequest(
                lora_name=adapter.name, lora_int_id=next(self._ids), lora_path=adapter.path
            )
            try:
                await engine.add_lora(request)
            except Exception as exc:  # vLLM's utility call raises a bare Exception(message)
                message = str(exc)
                if str(LoRAAdapterNotFoundError(adapter.name, adapter.path)) in message:
                    raise LoRAAdapterNotFound(message) from exc
                raise InvalidRequest(message) from exc
            self._requests[adapter.name] = request
            logger.info(
                "LoRA adapter %s loaded from %s (vLLM id %d)",
                adapter.name,
                adapter.path,
                request.lora_int_id,
            )
            if current is not None:
                await engine.remove_lora(current.lora_int_id)
        await self.refresh(engine)
        return request

    async def unload(self, engine: Any, name: str) -> bool:
        """Unload adapter ``name``; ``False`` when this engine did not load it."""
        self.require_slots()
        async with self._lock:
            request = self._requests.pop(name, None)
            if request is None:
                return False
            await engine.remove_lora(request.lora_int_id)
        await self.refresh(engine)
        return True

    async def refresh(self, engine: Any) -> None:
        """Read back which adapters vLLM holds (its LRU may have evicted some)."""
        ids = await engine.list_loras()
        names = sorted(
            name for name, request in self._requests.items() if request.lora_int_id in ids
        )
        self._held = tuple(names[:MAX_REPORTED_ADAPTERS])

    def refresh_soon(self, engine: Any) -> None:
        """:meth:`refresh` in the background, one at a time (after a request with an
        adapter: vLLM may have evicted another to run it)."""
        if self._refreshing is not None and not self._refreshing.done():
            return
        self._refreshing = asyncio.create_task(self._refresh_logged(engine))

    async def _refresh_logged(self, engine: Any) -> None:
        try:
            await self.refresh(engine)
        except Exception:  # the engine is shutting down; the next refresh reads it again
            logger.warning("could not read the LoRA adapters vLLM holds", exc_info=True)
