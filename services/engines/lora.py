"""LoRA adapters as the engines see them: :class:`LoRAAdapter` (a request's adapter, the
argument of :meth:`~services.engines.backend.EngineBackend.load_lora`) and its checks.

An adapter is named as vLLM's server names it (``--lora-modules name=path``,
``/v1/load_lora_adapter``): a name the router's ``/v1/models`` lists and a folder in the PEFT
layout (``adapter_config.json`` and the weights) on the engine's file system. A request carries
both, so an engine that does not hold the adapter (evicted, restarted since the load) loads it
from the path before it runs the request; prefill and decode of one request carry the same
adapter, and vLLM keys its prefix cache by name and path, so the KV the prefill made with it is
the KV the decode continues.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engines.errors import InvalidRequest

MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter: ``name`` (what a request's ``model`` says) and the folder it loads from."""

    name: str
    path: str

    def validate(self) -> None:
        """Raise :class:`InvalidRequest` for an empty or oversized name or path (what the
        engine reads is the folder's business: a bad folder is refused when loaded)."""
        if not 1 <= len(self.name) <= MAX_LORA_NAME_CHARS:
            raise InvalidRequest(f"LoRA adapter name must be 1 to {MAX_LORA_NAME_CHARS} characters")
        if not 1 <= len(self.path) <= MAX_LORA_PATH_CHARS:
            raise InvalidRequest(
                f"LoRA adapter {self.name!r}: path must be 1 to {MAX_LORA_PATH_CHARS} characters"
            )
        if "\0" in self.name or "\0" in self.path:
            raise InvalidRequest(f"LoRA adapter {self.name!r}: NUL in its name or path")
