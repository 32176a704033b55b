"""Methods pdserve adds to vLLM's workers (``--worker-extension-cls``), called by name through
``AsyncLLM.collective_rpc``. Imports vLLM only inside the methods (they run in vLLM's workers).

:meth:`PdserveWorkerExtension.pdserve_allocate_pp_buffer`: vLLM 0.32.0's model runner allocates
a PP stage's buffer for the tensors it receives from the stage before (``intermediate_tensors``)
only in ``_dummy_run``, which the CPU worker runs only as the warm-up of compiled graphs
(``CPUModelRunner.warming_up_model`` returns at once under ``--enforce-eager``). An eager PP > 1
engine on CPUs therefore failed its first request on every stage but the first
(``assert self.intermediate_tensors is not None`` in ``sync_and_gather_intermediate_tensors``)
and EngineCore died. The method allocates the buffer exactly as ``_dummy_run`` does; the backend
calls it once after start-up, before the engine takes requests.
"""

from __future__ import annotations

import importlib
from typing import Any

WORKER_EXTENSION = f"{__name__}.PdserveWorkerExtension"
ALLOCATE_PP_BUFFER = "pdserve_allocate_pp_buffer"


class PdserveWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``ParallelConfig.worker_extension_cls``)."""

    def pdserve_allocate_pp_buffer(self) -> bool:
        """Allocate this stage's receive buffer if it needs one and has none; True if it did."""
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        runner: Any = getattr(self, "model_runner")  # noqa: B009 (the worker's, at run time)
        if parallel_state.get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return False
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
        return True


__all__ = ["ALLOCATE_PP_BUFFER", "WORKER_EXTENSION", "PdserveWorkerExtension"]
