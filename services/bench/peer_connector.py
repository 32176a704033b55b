"""vLLM's own NIXL connectors, as ``pdserve bench peers`` runs them in the peer stack: stock
``NixlPullConnector`` / ``NixlPushConnector`` with exactly the CPU settings pdserve's own vLLM
engines run with, and nothing else.

On a CPU machine pdserve's engines do not spin while they wait for KV
(:func:`~services.engines.vllm._vllm_process.calm_idle_polling`: NIXL agents without their UCX
progress thread, which spins a core for as long as the agent lives; vLLM's workers pausing
instead of ``sched_yield`` between polls of their step queue; a pause after an engine step that
computed nothing). A stock ``vllm serve`` keeps all three, and on a 2-core machine those spinning
threads alone take most of it: a comparison against that peer measures the spin, not the
stack. These classes load the same module (its import applies the patches in each vLLM
process that builds a connector: the engine core's scheduler side and every worker) and add
the idle-step pause; the transfer protocol, its handshake and its leases are vLLM's.

pdserve's workers also keep their threads on their rank's cores where vLLM's NIXL worker pins
the forward pass's thread to the machine's last core
(:func:`~services.engines.vllm._vllm_process.worker_binding_kept`); so do the peer's, or both
of its engines compute on one core while pdserve's use two.

Named in the peer's ``--kv-transfer-config`` with ``"kv_connector_module_path":
"services.bench.peer_connector"``. Imports vLLM: loaded only inside vLLM's processes.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnector,
    NixlPushConnector,
)

from services.engines.vllm._vllm_process import CPU_IDLE_STEP_S, IS_CPU, worker_binding_kept


class _CalmIdleStep:
    """On CPUs, an engine step that scheduled nothing pauses first, and a worker's threads stay
    on its rank's cores (as pdserve's connector)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with worker_binding_kept() if role == KVConnectorRole.WORKER else nullcontext():
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if IS_CPU and scheduler_output.total_num_scheduled_tokens == 0:
            time.sleep(CPU_IDLE_STEP_S)
        return super().build_connector_meta(scheduler_output)  # type: ignore[misc]


class CalmNixlPullConnector(_CalmIdleStep, NixlPullConnector):  # type: ignore[misc]
    """vLLM's ``NixlConnector`` (decode READs the KV) with pdserve's CPU settings."""


class CalmNixlPushConnector(_CalmIdleStep, NixlPushConnector):  # type: ignore[misc]
    """vLLM's ``NixlPushConnector`` (prefill WRITEs the KV) with pdserve's CPU settings."""
