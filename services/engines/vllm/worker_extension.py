"""Methods pdserve adds to vLLM's GPU/CPU worker (vLLM's ``worker_extension_cls``), called by
the engine service through ``AsyncLLM.collective_rpc`` on every worker of the engine.

Imports vLLM inside the methods only: the class is named by its path in the engine arguments
and loaded in vLLM's worker processes.
"""

from __future__ import annotations

from typing import Any

WORKER_EXTENSION = "services.engines.vllm.worker_extension.PdserveWorkerExtension"
"""What :class:`~services.engines.vllm.backend.VllmBackend` passes as ``worker_extension_cls``."""

RELEASE_HELD_KV = "pdserve_release_held_kv"
"""The worker method freeing a prefilled request's KV held for a consumer (see below)."""


class PdserveWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``)."""

    def pdserve_release_held_kv(self, request_id: str) -> bool:
        """Free the KV this worker holds for ``request_id`` (vLLM's internal id of a finished
        prefill) on its next step, as if every consumer had read it: the router will send no
        consumer (the decode engine refused the request, failed or is gone). Returns whether
        this worker held it. Runs on the worker's main thread, between steps."""
        from vllm.distributed.kv_transfer import (  # noqa: PLC0415  (vLLM's worker process)
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        if not has_kv_transfer_group():
            return False
        worker: Any = get_kv_transfer_group().connector_worker
        return bool(worker is not None and worker.release_held(request_id))
