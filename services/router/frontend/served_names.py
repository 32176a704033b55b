"""The router's served names: what a request's ``model`` field may say, and what it runs on.

One table, :class:`ServedNames`, is where the router resolves a name: each name maps to the
base model its engines registered (``EngineRecord.model``, the key of the pools a request
goes to) and, for a LoRA adapter, the adapter the engines run it with. vLLM's front end
checks a request's name against its own ``OpenAIServingModels`` first (an unknown name is
answered with vLLM's 404 body) and hands the engine client vLLM's ``LoRARequest``; the engine
client turns that into a :class:`ServedName` here and nowhere else. Adapters enter through
vLLM's ``add_lora`` (``--lora-modules`` at start, ``/v1/load_lora_adapter``) and leave through
its unload (``services.router.frontend.vllm.lora``).

Several base models behind one router add one base name per model (:meth:`add_base`); an
adapter names its parent (vLLM's ``base_model_name``, else the first base).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engines.lora import LoRAAdapter


@dataclass(frozen=True)
class ServedName:
    """A name a request may give, resolved."""

    name: str
    model: str
    """The base model the engines registered (their pools' key)."""
    adapter: LoRAAdapter | None = None
    """The LoRA adapter the request runs with; ``None`` for a base model."""


class ServedNames:
    """Names -> :class:`ServedName`; see the module docstring."""

    def __init__(self) -> None:
        self._names: dict[str, ServedName] = {}
        self._first_base: str | None = None

    def add_base(self, name: str, model: str) -> None:
        """Serve base model ``model`` (as its engines registered it) under ``name``."""
        self._names[name] = ServedName(name, model)
        if self._first_base is None:
            self._first_base = name

    def add_adapter(self, adapter: LoRAAdapter, parent: str | None = None) -> ServedName:
        """Serve ``adapter`` on the base model served as ``parent`` (the first base model
        when ``None``); replaces an adapter of the same name. ``KeyError`` when ``parent``
        (or, without one, any base model) is not served; ``ValueError`` when the name is a
        base model's."""
        base = self._names[parent if parent is not None else self._require_first_base()]
        if base.adapter is not None:
            raise KeyError(f"{parent!r} is an adapter, not a base model")
        existing = self._names.get(adapter.name)
        if existing is not None and existing.adapter is None:
            raise ValueError(f"{adapter.name!r} is a served base model")
        served = ServedName(adapter.name, base.model, adapter)
        self._names[adapter.name] = served
        return served

    def remove_adapter(self, name: str) -> ServedName | None:
        """Stop serving adapter ``name``; returns what it was (``None``: no such adapter)."""
        served = self._names.get(name)
        if served is None or served.adapter is None:
            return None
        del self._names[name]
        return served

    def resolve(self, name: str | None) -> ServedName | None:
        """What ``name`` runs on (the first base model for ``None`` or an empty name, as
        vLLM's front end reads a request without ``model``); ``None`` when not served."""
        if not name:
            return self._names.get(self._first_base) if self._first_base is not None else None
        return self._names.get(name)

    def adapters(self) -> list[ServedName]:
        """Every adapter served, by name."""
        return sorted(
            (served for served in self._names.values() if served.adapter is not None),
            key=lambda served: served.name,
        )

    def _require_first_base(self) -> str:
        if self._first_base is None:
            raise KeyError("no base model is served")
        return self._first_base
