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
:data:`CONTEXT_FREE_TEXT`), the router detokenizes the request's whole output itself
(:class:`~services.tokenization.output_text.OutputText`, the engines' own rule, with the
router's tokenizer, the one that tokenized the prompt): text the broken leg still held is
released, stop strings that straddle the join are found, and what the client receives is what
an unbroken run would have sent. Usage counts each token once: ``completion_tokens`` is the
number of tokens the client received, ``prompt_tokens`` the original prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from services.engines.requests import FinishReason, SamplingParams, TokenLogprobs
from services.router.errors import EngineRequestFailed, RouterError
from services.router.scheduling.pool import EngineSlot
from services.tokenization.output_text import OutputText
from services.tokenization.tokenizer import Tokenizer

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

ENDS_BEFORE_INCOMPLETE = frozenset({"vllm"})
"""Engine kinds whose text ends before a trailing incomplete UTF-8 character (vLLM's
detokenizer never releases one); the others release it, as ``U+FFFD``, when the request ends.
A continued request's text, which the router detokenizes, ends as its last engine's would."""
CONTEXT_FREE_TEXT = frozenset({"stub", "sim"})
"""Engine kinds whose text for a token depends on that token alone (the synthetic engines'
``" t<id>"``): a continuation on them keeps the engines' text. The router's tokenizer could not
reproduce it (their ids run past its vocabulary: a drained sim engine's request once failed
there instead of migrating)."""

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


class Progress:
    """A request's output across legs: the tokens so far, and (from the first continuation
    on) the router's own detokenization of them. See the module docstring."""

    def __init__(self, prompt_token_ids: tuple[int, ...], sampling: SamplingParams) -> None:
        self._prompt = prompt_token_ids
        self._sampling = sampling
        self.generated: list[int] = []
        self._text: OutputText | None = None
        self.legs = 1
        self.continuing = False
        """Whether the current leg is a continuation (``legs > 1``)."""
        self.end_releases_incomplete = True
        """Whether the text ends with a trailing incomplete character (see :meth:`decode_on`)."""
        self._engine_kind: str | None = None

    def next_leg(self, tokenizer: Tokenizer) -> None:
        """Start a continuation of what was produced so far."""
        self.legs += 1
        self.continuing = True
        if self._engine_kind in CONTEXT_FREE_TEXT:
            return  # the engines' text stays exact across the join
        if self._text is None and self.generated:
            # Replaying the tokens marks released what the engines released (the same rule).
            self._text = OutputText(
                tokenizer,
                self._sampling.stop,
                already_released=self.generated,
                include_stop=self._sampling.include_stop_str_in_output,
                min_tokens=self._sampling.min_tokens,
            )

    def prompt(self) -> tuple[int, ...]:
        """The current leg's prompt: the original one plus every token produced so far."""
        return self._prompt + tuple(self.generated)

    def sampling(self) -> SamplingParams:
        """The current leg's sampling: what is left of ``max_tokens`` and ``min_tokens``; the
        prompt's logprobs went out with the first leg; the tokens so far, at the end of the
        leg's prompt, counted as output (``output_tokens_in_prompt``: the output penalties and
        a seeded random stream continue as in an unbroken run)."""
        if not self.generated:
            return self._sampling
        return replace(
            self._sampling,
            max_tokens=self.left(),
            min_tokens=max(self._sampling.min_tokens - len(self.generated), 0),
            prompt_logprobs=None,
            output_tokens_in_prompt=len(self.generated),
        )

    def left(self) -> int:
        return self._sampling.max_tokens - len(self.generated)

    def add(self, step: Step) -> tuple[str, FinishReason | None]:
        """Record ``step``; the text to send the client and the finish reason (a stop string
        the router found across the join finishes the request with ``stop``)."""
        self.generated.extend(step.token_ids)
        if self._text is None:
            return step.text, step.finish_reason
        ids = step.token_ids
        if (
            step.finish_reason is FinishReason.STOP
            and ids
            and ids[-1] in self._sampling.stop_token_ids
        ):
            ids = ids[:-1]  # a stop id is never returned as text
        pieces = []
        for token_id in ids:
            pieces.append(self._text.add(token_id))
            if self._text.stopped:
                return "".join(pieces), FinishReason.STOP
        if step.finish_reason is not None:
            pieces.append(self._text.flush(incomplete=self.end_releases_incomplete))
        return "".join(pieces), step.finish_reason

    def finish_text(self) -> str:
        """Text still held when the request ends without another step (``max_tokens`` were
        all produced when the broken leg ended)."""
        if self._text is None:
            return ""
        return self._text.flush(incomplete=self.end_releases_incomplete)

    def decode_on(self, engine_kind: str) -> None:
        """The current leg decodes on an engine of ``engine_kind``: the request's text ends by
        that engine's rule (and keeps that engine's text where it is context-free)."""
        self._engine_kind = engine_kind
        self.end_releases_incomplete = engine_kind not in ENDS_BEFORE_INCOMPLETE


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
