"""The reference scheduler's token rules: what a sequence samples next and what it returns.

:class:`TokenRules` samples a sequence's next token from its last logits (seeded per token when
the request has a seed; choices ``1 .. n-1`` of an ``n > 1`` prefill from the same logits, see
:mod:`~services.engines.reference.scheduler`) and judges what the token returns and whether it
finishes the sequence (EOS or a stop id past ``min_tokens``, a stop string, the length). The
functions below build the results a sequence sends (deltas, usage, prompt logprobs). Nothing
here touches the scheduler's queues or blocks.
"""

from __future__ import annotations

import torch

from services.engines.reference.request_state import EngineRequest
from services.engines.reference.sampling import (
    OutputText,
    make_generator,
    process_logits,
    sample_token,
    token_generator,
    token_logprobs,
)
from services.engines.requests import (
    FinishReason,
    FirstToken,
    KVHandle,
    PrefillResult,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from services.tokenization.tokenizer import Tokenizer

Judged = tuple[tuple[int, ...], str, FinishReason | None]
"""A token's returned ids (none when it stopped the sequence unreturned), its text, its finish."""


class TokenRules:
    """Sampling and finishing for one engine (its tokenizer, EOS ids and context length)."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._max_model_len = max_model_len

    def output_text(self, sampling: SamplingParams, released: tuple[int, ...]) -> OutputText:
        """A sequence's incremental detokenizer; ``released``: tokens already returned."""
        return OutputText(
            self._tokenizer,
            sampling.stop,
            already_released=released,
            include_stop=sampling.include_stop_str_in_output,
            min_tokens=sampling.min_tokens,
        )

    def judge(
        self,
        sampling: SamplingParams,
        prompt_len: int,
        output_len: int,
        token: int,
        text: OutputText,
    ) -> Judged:
        """What output token ``output_len`` (1-based) returns: its ids, its text and the
        finish it causes (EOS or a stop id past ``min_tokens``, a stop string, the length)."""
        stops = token in sampling.stop_token_ids or (token in self._eos and not sampling.ignore_eos)
        if stops and output_len > sampling.min_tokens:
            return (), text.flush(), FinishReason.STOP
        released = text.add(token)
        if text.stopped:
            return (token,), released, FinishReason.STOP
        if output_len >= sampling.max_tokens or prompt_len + output_len >= self._max_model_len:
            return (token,), released + text.flush(), FinishReason.LENGTH
        return (token,), released, None

    def next_token(
        self, request: EngineRequest, last: torch.Tensor
    ) -> tuple[int, TokenLogprobs | None, tuple[FirstToken, ...]]:
        """Sample ``request``'s next token from its last logits: the token, its logprobs (when
        asked for) and, for an ``n > 1`` prefill, the first tokens of choices ``1 .. n-1``."""
        sampling = request.sampling
        seed = sampling.seed
        position = sampling.output_tokens_in_prompt + len(request.output)
        generator = request.generator if seed is None else token_generator(seed, position)
        stop_ids = (
            sampling.stop_token_ids
            if sampling.ignore_eos
            else (*sampling.stop_token_ids, *self._eos)
        )
        processed = process_logits(last, sampling, request.prompt, request.output, stop_ids)
        token = sample_token(processed, sampling, generator)
        logprobs = (
            token_logprobs(last, token, sampling.logprobs)
            if sampling.logprobs is not None
            else None
        )
        more: tuple[FirstToken, ...] = ()
        if request.kind == "prefill" and sampling.n > 1:
            more = self._more_choices(request, last, processed)
        return token, logprobs, more

    def _more_choices(
        self, request: EngineRequest, last: torch.Tensor, processed: torch.Tensor
    ) -> tuple[FirstToken, ...]:
        """The first tokens of choices ``1 .. n-1`` of a prefill (choice ``i`` sampled with
        ``sampling.for_choice(i)``)."""
        firsts: list[FirstToken] = []
        for choice in range(1, request.sampling.n):
            sampling = request.sampling.for_choice(choice)
            seed = sampling.seed
            generator = make_generator(None) if seed is None else token_generator(seed, 0)
            token = sample_token(processed, sampling, generator)
            logprobs = (
                token_logprobs(last, token, sampling.logprobs)
                if sampling.logprobs is not None
                else None
            )
            _, text, finish = self.judge(
                sampling, len(request.prompt), 1, token, self.output_text(sampling, ())
            )
            firsts.append(FirstToken(token, text, finish, logprobs))
        return tuple(firsts)


def add_prompt_logprobs(request: EngineRequest, start: int, rows: torch.Tensor) -> None:
    """Row ``j`` of a prompt chunk starting at ``start`` predicts prompt token ``start + j + 1``."""
    top = request.sampling.prompt_logprobs or 0
    prompt = request.prompt
    for j in range(rows.shape[0]):
        position = start + j + 1
        if position < len(prompt):
            request.prompt_logprobs.append(token_logprobs(rows[j], prompt[position], top))


def take_prompt_logprobs(request: EngineRequest) -> tuple[TokenLogprobs, ...]:
    """The prompt logprobs, once (on the request's first result)."""
    if request.prompt_logprobs_sent or request.sampling.prompt_logprobs is None:
        return ()
    request.prompt_logprobs_sent = True
    return tuple(request.prompt_logprobs)


def usage(request: EngineRequest) -> Usage:
    return Usage(
        prompt_tokens=len(request.prompt),
        completion_tokens=len(request.output),
        cached_tokens=request.cached_tokens,
        cache_write_tokens=request.cache_write_tokens,
    )


def token_delta(
    request: EngineRequest,
    token_ids: tuple[int, ...],
    text: str,
    finish: FinishReason | None,
    logprobs: tuple[TokenLogprobs, ...] = (),
) -> TokenDelta:
    """A decoding sequence's next delta (its KV transfer time and prompt logprobs on the
    first, and a local request's cached tokens; usage on the last)."""
    kv_s, request.kv_transfer_s = request.kv_transfer_s, None
    cached = None
    if request.kind != "remote" and not request.cached_tokens_sent:
        request.cached_tokens_sent = True
        cached = request.cached_tokens
    return TokenDelta(
        token_ids,
        text,
        finish,
        usage(request) if finish is not None else None,
        kv_transfer_s=kv_s,
        cached_tokens=cached,
        logprobs=logprobs,
        prompt_logprobs=take_prompt_logprobs(request),
        choice=request.choice,
    )


def abort_delta(request: EngineRequest) -> TokenDelta:
    return TokenDelta((), "", FinishReason.ABORT, usage(request), choice=request.choice)


def prefill_result(
    request: EngineRequest,
    token: int,
    text: str,
    handle: KVHandle | None,
    finish: FinishReason | None,
    logprobs: TokenLogprobs | None,
    more: tuple[FirstToken, ...],
    prefill_s: float,
) -> PrefillResult:
    """A prefill's result: its first token (and those of choices ``1 .. n-1``), the handle of
    the KV its ranks hold (``None`` when every choice finished)."""
    return PrefillResult(
        request_id=request.request_id,
        first_token_id=token,
        # Held-back text stays held: the decode engine replays this token through its own
        # OutputText and releases it exactly where a colocated engine would.
        text=text,
        kv_handle=handle,
        finish_reason=finish,
        usage=usage(request),
        prefill_s=prefill_s,
        queue_s=request.admitted_at - request.arrived_at,
        logprobs=logprobs,
        prompt_logprobs=take_prompt_logprobs(request),
        more_choices=more,
    )
