"""Placement by LoRA adapter: which engines may run a request that names an adapter, and which
of them the policy chooses among.

Two steps, each a filter over the candidates a stage of :class:`~.scheduler.Scheduler` has
(the policy then chooses among what is left, as for any request):

1. :func:`lora_capable`: only engines that registered LoRA slots (``EngineRecord.max_loras >
   0``) run an adapter; an engine without (the reference engine, vLLM without
   ``--enable-lora``) is never sent one. No request ever runs on the base model instead.
2. :func:`prefer_holders`: among those, the engines whose load record says they hold the
   adapter (``EngineLoad.lora_adapters``); when none does, every capable engine, and the one
   the policy chooses loads the adapter from its path before it runs the request (the
   request carries name and path), counted in ``pdserve_router_lora_loads_total``. So an
   adapter's requests stay on the engines that hold it (and with them its prefixes, which
   vLLM keys by adapter), and an adapter no engine holds (evicted everywhere, or an engine
   restarted since the load) goes where load and cache say, as a base-model request would.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.router.scheduling.pool import EngineSlot


def lora_capable(candidates: Sequence[EngineSlot], lora_name: str | None) -> list[EngineSlot]:
    """``candidates`` that can run a request with adapter ``lora_name`` (all of them for a
    base-model request)."""
    if lora_name is None:
        return list(candidates)
    return [slot for slot in candidates if slot.record.max_loras > 0]


def prefer_holders(
    candidates: Sequence[EngineSlot], lora_name: str | None
) -> tuple[list[EngineSlot], bool]:
    """The candidates to choose among for adapter ``lora_name`` and whether the chosen one
    must load it first (no candidate holds it). ``candidates`` are :func:`lora_capable`."""
    if lora_name is None:
        return list(candidates), False
    holders = [slot for slot in candidates if lora_name in slot.load.lora_adapters]
    if holders:
        return holders, False
    return list(candidates), True
