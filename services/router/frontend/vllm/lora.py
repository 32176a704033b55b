"""LoRA adapters through the router: vLLM's adapter calls carried out on every engine.

vLLM's front end manages adapters in ``OpenAIServingModels``: ``--lora-modules`` at start
(``init_static_loras``) and ``/v1/load_lora_adapter`` (behind
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as in vLLM) check the request, then call the engine
client's ``add_lora``; ``/v1/models`` lists the adapters with their parent and root. Below
that seam, :class:`LoRAFanout` loads the adapter on every READY engine of its base model that
has LoRA slots, prefill and decode pools alike (``EngineService.LoadLoRA``), and enters it in
the router's :class:`~services.router.frontend.served_names.ServedNames`.

Where pdserve differs from vLLM's server, one class says so: :class:`PdserveServingModels`
(vLLM's ``OpenAIServingModels`` with three changes, adopted once vLLM built it):

- a load when the base model's engines have no LoRA slots (reference engines, vLLM without
  ``--enable-lora``) is refused with a 400 naming the engines;
- a load that fails on some engines only is answered 500 saying it is partial and where it
  failed; the adapter is served by the engines that loaded it (placement sends its requests
  only there while one of them holds it), the others keep what they had, and a load with
  ``load_inplace`` tries every engine again;
- an unload also unloads the adapter from the engines (vLLM's server only forgets the name;
  here the engines' slots and load records follow).

A load that fails on every engine raises the engines' message, which vLLM's handler answers
as vLLM's server does (404 with vLLM's ``LoRAAdapterNotFoundError`` text for a folder it
finds nothing in, else 500 with the message).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve import create_error_response

from services.control_plane.wire import EngineId, EngineRecord
from services.engines.errors import InvalidRequest
from services.engines.lora import LoRAAdapter
from services.router.frontend.served_names import ServedName, ServedNames
from services.router.metrics import RouterMetrics
from services.router.scheduling.pool import EnginePool, EngineSlot

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0
"""The longest one engine's load (or unload) of an adapter may take (reading its weights)."""


@dataclass(frozen=True)
class LoadReport:
    """Where one load of an adapter went."""

    name: str
    loaded: tuple[EngineId, ...]
    failed: tuple[tuple[EngineId, str], ...]
    """``(engine, the engine's message)`` of each engine that refused or could not load it."""

    @property
    def partial(self) -> bool:
        return bool(self.loaded) and bool(self.failed)

    def message(self) -> str:
        """What the load's answer says when it is partial."""
        where = "; ".join(f"{engine}: {message}" for engine, message in self.failed)
        return (
            f"LoRA adapter '{self.name}' loaded on {len(self.loaded)} of "
            f"{len(self.loaded) + len(self.failed)} engines (partial): failed on {where}. "
            "Its requests go to the engines that hold it; load it again with load_inplace "
            "to retry the others."
        )


def lora_refusal(records: Iterable[EngineRecord], name: str) -> str | None:
    """Why adapter ``name`` cannot run on the engines of ``records`` (those of its base
    model), or ``None`` when one of them has LoRA slots (or there is none yet)."""
    records = list(records)
    if not records or any(record.max_loras > 0 for record in records):
        return None
    engines = ", ".join(f"{r.engine_id} ({r.engine_kind} engine)" for r in records)
    return f"LoRA adapter '{name}' cannot run: no LoRA slots on engine(s) {engines}"


class LoRAFanout:
    """Loads and unloads adapters on every engine of their base model (module docstring)."""

    def __init__(
        self, pool: EnginePool, names: ServedNames, metrics: RouterMetrics, model: str
    ) -> None:
        """``model``: the base model (as served) of the front end this fanout serves, the
        parent of an adapter loaded without one."""
        self._pool = pool
        self.names = names
        self.model = model
        self._metrics = metrics
        self.reports: dict[str, LoadReport] = {}
        """The last load of each adapter (what :class:`PdserveServingModels` answers)."""

    def engines_of(self, model: str) -> list[EngineSlot]:
        return [slot for slot in self._pool.slots() if slot.record.model == model]

    def refusal(self, name: str, parent: str | None) -> str | None:
        """Why a load of adapter ``name`` on base ``parent`` is refused before any engine is
        asked (see :func:`lora_refusal`)."""
        base = self._base(parent)
        if base is None:
            return None  # vLLM's own checks name what is wrong
        return lora_refusal((slot.record for slot in self.engines_of(base.model)), name)

    async def load(self, lora_request: Any) -> LoadReport:
        """vLLM's ``add_lora``: load on every engine with slots of the adapter's base model.
        Raises ``ValueError`` (what vLLM's handler answers) when none loaded it: the
        engines' message, or why none can."""
        adapter = LoRAAdapter(str(lora_request.lora_name), str(lora_request.lora_path))
        try:
            adapter.validate()
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc
        parent = getattr(lora_request, "base_model_name", None)
        base = self._base(parent)
        if base is None:
            raise ValueError(f"LoRA adapter '{adapter.name}': no base model {parent!r} is served")
        slots = self.engines_of(base.model)
        refusal = lora_refusal((slot.record for slot in slots), adapter.name)
        if refusal is not None:
            raise ValueError(refusal)
        capable = [slot for slot in slots if slot.record.max_loras > 0]
        replace = bool(getattr(lora_request, "load_inplace", False))
        results = await asyncio.gather(
            *(self._load_one(slot, adapter, replace) for slot in capable), return_exceptions=True
        )
        loaded: list[EngineId] = []
        failed: list[tuple[EngineId, str]] = []
        for slot, result in zip(capable, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                logger.warning(
                    "LoRA adapter %s: load on %s failed: %s", adapter.name, slot.engine_id, result
                )
                failed.append((slot.engine_id, str(result)))
            else:
                loaded.append(slot.engine_id)
        report = LoadReport(adapter.name, tuple(loaded), tuple(failed))
        if failed and not loaded:
            raise ValueError(failed[0][1])
        self.names.add_adapter(adapter, base.name)
        self.reports[adapter.name] = report
        return report

    def _base(self, parent: str | None) -> ServedName | None:
        """The served base model an adapter of ``parent`` (``None``: this front end's) runs on."""
        base = self.names.resolve(parent if parent is not None else self.model)
        return base if base is not None and base.adapter is None else None

    async def _load_one(self, slot: EngineSlot, adapter: LoRAAdapter, replace: bool) -> None:
        try:
            held = await slot.connector.load_lora(
                adapter, load_inplace=replace, timeout_s=LOAD_TIMEOUT_S
            )
        except Exception:
            self._metrics.lora_loads.labels(pool="api", outcome="failed").inc()
            raise
        self._metrics.lora_loads.labels(pool="api", outcome="ok").inc()
        # The engine's next heartbeat says the same; placement needs it from now on.
        slot.load = dataclasses.replace(slot.load, lora_adapters=held)

    async def unload(self, name: str) -> ServedName | None:
        """Stop serving adapter ``name`` and unload it from its base model's engines (an
        engine that cannot is logged: its LRU drops the adapter in time)."""
        served = self.names.remove_adapter(name)
        self.reports.pop(name, None)
        if served is None:
            return None
        capable = [slot for slot in self.engines_of(served.model) if slot.record.max_loras > 0]
        for slot in capable:
            slot.lora_unloads.add(name)
        results = await asyncio.gather(
            *(slot.connector.unload_lora(name, timeout_s=LOAD_TIMEOUT_S) for slot in capable),
            return_exceptions=True,
        )
        for slot, result in zip(capable, results, strict=True):
            if isinstance(result, Exception):
                logger.warning(
                    "LoRA adapter %s: unload on %s failed: %s", name, slot.engine_id, result
                )
        return served


class PdserveServingModels(OpenAIServingModels):  # type: ignore[misc]  # (vLLM is untyped here)
    """vLLM's ``OpenAIServingModels`` with pdserve's three differences (module docstring).
    :func:`adopt` turns the instance vLLM's ``init_app_state`` built into one."""

    fanout: LoRAFanout

    async def load_lora_adapter(self, request: Any, base_model_name: str | None = None) -> Any:
        refusal = self.fanout.refusal(request.lora_name, base_model_name)
        if refusal is not None and request.lora_name and request.lora_path:
            return create_error_response(
                message=refusal, err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST
            )
        answer = await super().load_lora_adapter(request, base_model_name)
        report = self.fanout.reports.get(request.lora_name)
        if isinstance(answer, str) and report is not None and report.partial:
            return create_error_response(
                message=report.message(),
                err_type="InternalServerError",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
            )
        return answer

    async def unload_lora_adapter(self, request: Any) -> Any:
        answer = await super().unload_lora_adapter(request)
        if isinstance(answer, str):
            await self.fanout.unload(request.lora_name)
        return answer


def adopt(models: OpenAIServingModels, fanout: LoRAFanout) -> PdserveServingModels:
    """Make the ``OpenAIServingModels`` vLLM built (and handed to its serving classes) a
    :class:`PdserveServingModels` over ``fanout``: the class adds methods only, no state but
    ``fanout``, so the instance's own state (its adapters, its locks) carries over."""
    models.__class__ = PdserveServingModels
    adopted: PdserveServingModels = models
    adopted.fanout = fanout
    return adopted
