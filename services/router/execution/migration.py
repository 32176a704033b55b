"""Failover and migration of one request across engines (used by
``services.router.execution.executor``).

A request runs in *legs*. The first leg is the plan (prefill then decode, or local). When a leg
breaks through an engine's fault, the next leg continues the same request on other engines:

- **prefill failover**: the decode engine reports, before its first delta, that the KV it was
  to pull is gone (producer not READY, handle unknown or expired: phase ``kv_wait``; the pull
  itself failed, e.g. the producer died mid-transfer: phase ``kv_pull``). The next leg
  prefills elsewhere (the failed producer avoided), bounded by ``max_prefill_attempts``,
  counted in ``pdserve_router_prefill_retries_total{phase, reason}``. (Failures of the Prefill
  call itself, phases ``connect`` and ``prefill``, are retried inside the leg.)
- **migration**: the decode engine failed, went away or stalled past the idle bound (or
  refused the request while overloaded or draining). The next leg avoids it, bounded by
  ``max_migrations``, counted in ``pdserve_router_migrations_total{reason}``.

Every next leg is a *continuation*: its prompt is the original prompt plus every token the
request produced so far (the client already has them, the prefill's first token included),
its ``max_tokens`` what is left, and ``output_tokens_in_prompt`` says how many of its prompt
tokens are output: the engine counts them in the frequency and presence penalties and a seeded
request's random stream skips their draws. Greedy output, penalized or not, is exactly the
output of an unbroken run, and so is a seeded request's wherever the engines sample each token
with one draw of the request's own stream (the reference engine; vLLM's V1 runner, CPU included;
vLLM's V2 runner keys its noise by position).

Text: an engine releases text lagging its tokens (an incomplete UTF-8 character, a possible
stop-string prefix), and a continuation's engine knows nothing of the tokens before its prompt's
end. So from the first continuation on (except on engines whose text is context-free,
:data:`~services.router.execution.executor.CONTEXT_FREE_TEXT`), the router detokenizes the
request's whole output itself (:class:`~services.router.execution.executor.Progress`, beside
the executor's loop of legs that keeps it, with
:class:`~services.tokenization.output_text.OutputText`: the engines' own rule, with the
router's tokenizer, the one that tokenized the prompt): text the broken leg still held is
released, stop strings that straddle the join are found, and what the client receives is what
an unbroken run would have sent. Usage counts each token once: ``completion_tokens`` is the
number of tokens the client received, ``prompt_tokens`` the original prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from services.engines.requests import FinishReason, TokenLogprobs
from services.router.errors import EngineRequestFailed, RouterError
from services.router.scheduling.pool import EngineSlot

Phase = Literal["connect", "prefill", "kv_wait", "kv_pull"]

ENGINE_FAULTS = frozenset(
    {
        "engine_failed",
        "engine_unreachable",
        "engine_timeout",
        "protocol_mismatch",
        "decode_failed",
        "decode_truncated",
    }
)
"""Error codes that say the engine itself is broken: its circuit breaker opens."""

PRODUCER_GONE: dict[str, Phase] = {
    "producer_unavailable": "kv_wait",
    "kv_handle_unknown": "kv_wait",
    "kv_lease_expired": "kv_wait",
    "kv_transfer_failed": "kv_pull",
}
"""Decode errors, before the first delta, that blame the producer of the KV: the phase."""

_MIGRATABLE = ENGINE_FAULTS | {"engine_overloaded", "engine_draining", "request_cancelled"}


def is_engine_fault(error: RouterError) -> bool:
    """Whether ``error`` counts against the engine's circuit breaker."""
    if not isinstance(error, EngineRequestFailed):
        return False
    # ``engine_error`` is retryable only when it was unexpected on our side of the call.
    return error.code in ENGINE_FAULTS or (error.code == "engine_error" and error.retryable)


def is_migratable(error: RouterError) -> bool:
    """Whether another decode engine may succeed where this one failed."""
    return isinstance(error, EngineRequestFailed) and (
        error.code in _MIGRATABLE or (error.code == "engine_error" and error.retryable)
    )


def prefill_phase(error: RouterError) -> Phase:
    """The phase label of a failed Prefill call."""
    return "connect" if error.code == "engine_unreachable" else "prefill"


@dataclass(frozen=True)
class Step:
    """What one leg produced in one message: token ids, the engine's text for them, and the
    finish reason on the last."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class LegFailed(Exception):
    """A leg broke where another leg may get past: ``phase`` set (``kv_wait``/``kv_pull``)
    when the producer ``slot`` is to blame, ``None`` when the decode engine ``slot`` is."""

    def __init__(self, error: RouterError, slot: EngineSlot, phase: Phase | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.slot = slot
        self.phase = phase


class NoContinuation(Exception):
    """No engine left to continue a broken request on (``error``: the scheduler's)."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error
