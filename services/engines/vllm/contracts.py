"""vLLM's connector contracts that pdserve enforces itself (pure, no vLLM import).

*Exactly-once reports.* vLLM's ``KVOutputAggregator`` counts, per request id, one report of a
finished send (or receive) from every worker of the engine (``world_size = PP x TP``, unless the
connector overrides ``get_finished_count``; ours does not), and non-final PP ranks report too.
A worker that reports an id twice makes the aggregator finish the request one report early,
which frees KV another rank is still sending. :class:`FinishedOnce` sits between the NIXL worker
and the aggregator: it passes each id once per direction and drops (and counts) repeats.

*Nothing to receive.* A decode engine whose prefix cache already holds every block the producer
computed (the same prompt again, a prompt at a block multiple) transfers nothing:
:func:`holds_producer_blocks` decides it in the consumer's scheduler, which then loads nothing
asynchronously (vLLM computes the first token's slot locally) and tells the producer at once, so
the producer frees its blocks instead of holding them for a lease (push: a release registration,
:data:`RELEASE_KEY`; pull: vLLM's empty read, a notification per producer rank). A push the
producer cannot carry out is reported to the consumer at once (:data:`PUSH_FAILED_KEY`), whose
request then fails per vLLM's ``kv_load_failure_policy`` instead of waiting for a WRITE that will
never come.

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


RELEASE_KEY = "pdserve_release"
"""A push registration carrying this key (its value the reason) asks the producer for nothing:
it frees the request's blocks at once and counts the release by that reason."""

PUSH_FAILED_KEY = "pdserve_push_failed"
"""A notification from the producer on vLLM's push-registration channel carrying this key (its
value what failed) fails the consumer's receive of that request at once."""

RELEASE_REASONS = ("consumer_holds_prompt", "push_failed", "consumer_gone")
"""Every reason a producer frees a request's blocks at once, before any consumer read them:
the consumer's prefix cache held every block, the push failed (the request goes on elsewhere),
or no consumer will come (the router aborted the prefilled request: its decode engine refused
it, failed or is gone)."""


def _groups(block_ids: Any) -> list[Sequence[int]]:
    """Block ids per KV group; a flat list is one group."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids)
    return [block_ids or ()]


def holds_producer_blocks(producer: Any, num_computed_tokens: int, block_size: int) -> bool:
    """Whether a consumer whose prefix cache computed ``num_computed_tokens`` (whole blocks)
    already holds every block the producer computed (``producer``: its block ids per group,
    or one flat group), so nothing is to be transferred. ``False`` when the producer holds no
    block (then there is nothing to release either)."""
    most = max((len(group) for group in _groups(producer)), default=0)
    return most > 0 and num_computed_tokens >= most * block_size


def no_blocks(block_ids: Any) -> bool:
    """Whether a block-id list (per group or flat) names no block at all."""
    return not any(_groups(block_ids))


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


def advance_grammar(request: Any, key: str) -> bool:
    """Feed a structured-output request's grammar the output tokens vLLM sees as prompt.

    pdserve's decode request is the prompt plus the producer's first token (a continuation's
    output so far too); vLLM's grammar only ever accepts tokens the engine samples, so it would
    constrain the next token as if it were the first. The tokens travel in
    ``request.sampling_params.extra_args[key]`` (``request_mapping.GRAMMAR_PREFIX_ARG``); the
    connector's scheduler calls this when vLLM first looks the request up for KV, which vLLM
    does only once the grammar compiled, before the request's first step. The key is removed:
    a grammar accepts the tokens once. Returns whether the grammar accepted them (``True``
    when there was nothing to feed); a refusal is logged, the request samples on from the
    grammar's own state."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    if not extra or key not in extra:
        return True
    tokens = list(extra.pop(key))
    structured = getattr(request, "structured_output_request", None)
    grammar = structured.grammar if structured is not None else None
    if grammar is None or isinstance(grammar, Exception):
        logger.error(
            "request %s: no compiled grammar to feed its %d earlier output token(s)",
            request.request_id,
            len(tokens),
        )
        return False
    if not grammar.accept_tokens(request.request_id, tokens):
        logger.error(
            "request %s: the grammar refused its earlier output %s",
            request.request_id,
            tokens,
        )
        return False
    return True
