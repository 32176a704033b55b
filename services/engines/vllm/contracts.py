"""vLLM's connector contracts that pdserve enforces itself (pure, no vLLM import).

*Exactly-once reports.* vLLM's ``KVOutputAggregator`` counts, per request id, one report of a
finished send (or receive) from every worker of the engine (``world_size = PP x TP``, unless the
connector overrides ``get_finished_count``; ours does not), and non-final PP ranks report too.
A worker that reports an id twice makes the aggregator finish the request one report early,
which frees KV another rank is still sending. :class:`FinishedOnce` sits between the NIXL worker
and the aggregator: it passes each id once per direction and drops (and counts) repeats.

*Model-runner choice.* With speculative decoding, KV saves must be finalized (``wait_for_save``)
after the drafter wrote its KV (vLLM PR #43719); vLLM 0.32.0's V1 model runner defers the
finalization past the drafter, and pdserve has not verified the V2 runner's order. The rule of
:func:`decide_model_runner` is precise: only a connector that is actually active (a connector
name and a role, not merely the ``KVTransferConfig`` object vLLM always creates) together with a
speculative config forces the V1 runner; anything else leaves vLLM's own choice alone. The
decision and its reason are logged by the caller.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_LEDGER_SIZE = 65536
"""Request ids remembered per direction; far above any number of in-flight transfers."""


class FinishedOnce:
    """Passes each finished request id once per direction for one worker; see module doc."""

    def __init__(self, capacity: int = DEFAULT_LEDGER_SIZE) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._capacity = capacity
        self._seen: dict[str, OrderedDict[str, None]] = {
            "send": OrderedDict(),
            "recv": OrderedDict(),
        }
        self.duplicates = {"send": 0, "recv": 0}
        """Reports dropped because this worker already reported the id (a connector bug)."""

    def filter(self, direction: str, req_ids: Iterable[str]) -> set[str]:
        """The ids of ``req_ids`` not reported before in ``direction`` (``send``/``recv``)."""
        seen = self._seen[direction]
        fresh: set[str] = set()
        dropped: list[str] = []
        for req_id in req_ids:
            if req_id in seen or req_id in fresh:
                self.duplicates[direction] += 1
                dropped.append(req_id)
                continue
            fresh.add(req_id)
        if dropped:
            logger.warning(
                "dropped repeated finished-%s reports of %s (a connector bug; vLLM's aggregator "
                "would have finished them early)",
                direction,
                sorted(dropped),
            )
        for req_id in sorted(fresh):
            seen[req_id] = None
            if len(seen) > self._capacity:
                seen.popitem(last=False)
        return fresh


@dataclass(frozen=True)
class RunnerDecision:
    """What to set ``VLLM_USE_V2_MODEL_RUNNER`` to (``None``: leave it) and why."""

    use_v2: bool | None
    reason: str


def connector_is_active(kv_connector: str | None, kv_role: str | None) -> bool:
    """True only when a connector will actually be instantiated (a name and a role)."""
    return bool(kv_connector) and kv_role is not None


def decide_model_runner(
    *, kv_connector: str | None, kv_role: str | None, speculative: bool, env_value: str | None
) -> RunnerDecision:
    """The model-runner rule; see the module docstring. ``env_value`` is the operator's
    ``VLLM_USE_V2_MODEL_RUNNER`` (an explicit V2 with an active connector and speculation is
    refused rather than silently overridden)."""
    active = connector_is_active(kv_connector, kv_role)
    if not active:
        return RunnerDecision(None, "no active KV connector: vLLM chooses the model runner")
    if not speculative:
        return RunnerDecision(
            None, f"KV connector {kv_connector} active without speculative decoding: vLLM chooses"
        )
    if env_value is not None and env_value.strip().lower() in ("1", "true"):
        raise ValueError(
            f"VLLM_USE_V2_MODEL_RUNNER={env_value} with KV connector {kv_connector} and "
            "speculative decoding: pdserve requires the V1 runner, which finalizes KV saves "
            "after the drafter; unset the variable"
        )
    return RunnerDecision(
        False,
        f"KV connector {kv_connector} ({kv_role}) active with speculative decoding: V1 runner, "
        "which finalizes KV saves after the drafter",
    )


def clip_to_producer(local: Any, producer: Any, allocated: Sequence[int]) -> Any:
    """The consumer's transfer block ids per KV group without the blocks past the producer's.

    pdserve's decode request is the prompt plus the first token, so when the prompt fills its
    last block the consumer allocates one block more than the producer computed, and vLLM
    0.32.0 asserts equal counts (push: the writer; pull: ``_apply_prefix_caching``). ``local``
    holds the blocks to transfer (those the consumer's prefix cache did not cover, at the end
    of the request's blocks); ``allocated`` counts every block the consumer allocated per
    group, cached ones included; ``producer`` is the producer's blocks per group. The blocks
    past the producer's count are dropped from the end (vLLM computes the last token's slot
    locally anyway). A flat list is one group.
    """
    if not local:
        return local  # a full prefix-cache hit: nothing to transfer
    grouped = isinstance(local[0], (list, tuple))
    local_groups = local if grouped else [local]
    producer_groups = (
        producer if producer and isinstance(producer[0], (list, tuple)) else [producer]
    )
    clipped = []
    for index, group in enumerate(local_groups):
        blocks = list(group)
        if index < len(producer_groups) and index < len(allocated):
            extra = max(0, allocated[index] - len(producer_groups[index]))
            blocks = blocks[: max(0, len(blocks) - extra)]
        clipped.append(blocks)
    return type(local)(clipped) if grouped else clipped[0]
