"""vLLM's logprobs (``{token id: Logprob(logprob, rank, decoded_token)}`` per position) as
pdserve's :class:`~services.engines.requests.TokenLogprobs`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.engines.requests import TokenLogprobs


def token_logprobs(token_id: int, candidates: Mapping[int, Any], top: int) -> TokenLogprobs:
    """One position of vLLM's logprobs (``{token id: Logprob(logprob, rank, ...)}``, the chosen
    token and the ``top`` most likely) as a :class:`TokenLogprobs`."""
    chosen = candidates[token_id]
    ranked = sorted(candidates.items(), key=lambda item: item[1].rank or 0)
    best = tuple(
        (int(tid), float(lp.logprob))
        for tid, lp in ranked
        if lp.rank is not None and lp.rank <= top
    )
    return TokenLogprobs(
        token_id=int(token_id),
        logprob=float(chosen.logprob),
        rank=int(chosen.rank or 1),
        top=best,
    )


def output_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None, top: int | None
) -> tuple[TokenLogprobs, ...]:
    """The logprobs of a vLLM ``CompletionOutput`` delta (empty unless asked)."""
    if top is None or not logprobs:
        return ()
    return tuple(
        token_logprobs(int(token), candidates, top)
        for token, candidates in zip(token_ids, logprobs, strict=False)
    )


def prompt_logprobs_of(
    prompt: Sequence[int], logprobs: Sequence[Mapping[int, Any] | None] | None, top: int | None
) -> tuple[TokenLogprobs, ...]:
    """vLLM's ``RequestOutput.prompt_logprobs`` (``None`` first) for prompt tokens 1.."""
    if top is None or not logprobs:
        return ()
    return tuple(
        token_logprobs(int(token), candidates, top)
        for token, candidates in zip(prompt[1:], logprobs[1:], strict=False)
        if candidates is not None
    )
