"""The module vLLM loads through ``kv_connector_module_path`` (light to import).

Configure vLLM with::

    --kv-transfer-config '{"kv_connector": "PdservePushConnector",
        "kv_connector_module_path": "services.engines.vllm.connector",
        "kv_role": "kv_producer", "engine_id": "<engine_id>.g<generation>",
        "kv_connector_extra_config": {"pdserve": {...}}}'

(:class:`~services.engines.vllm.backend.VllmBackend` writes exactly this.) The classes are
:class:`PdservePushConnector` (prefill WRITEs; needed for PP > 1 prefill),
:class:`PdservePullConnector` (decode READs; PP=1 both sides) and ``PdserveConnector``
(= push). Importing this module imports nothing heavy and connects to nothing: the classes are
built from :mod:`services.engines.vllm._connector_impl` (which imports vLLM) on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

CONNECTOR_CLASSES = ("PdservePushConnector", "PdservePullConnector", "PdserveConnector")
MODULE_PATH = __name__


def __getattr__(name: str) -> Any:
    if name in CONNECTOR_CLASSES:
        implementation = importlib.import_module("services.engines.vllm._connector_impl")
        return getattr(implementation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *CONNECTOR_CLASSES])
