"""vLLM's request outputs in pdserve's terms: a prefill's last output as a
:class:`PrefillResult` (:func:`prefill_result`), each decode output as a :class:`TokenDelta`
(:func:`token_delta`), vLLM's finish reasons (:func:`finish_reason_of`). The way in is
:mod:`.request_mapping`. Imports nothing of vLLM: the outputs are read by attribute
(``RequestOutput``: ``outputs[0]``, ``num_cached_tokens``, ``prompt_logprobs``...)."""

from __future__ import annotations

from typing import Any

from services.engines.errors import EngineFailed, KVTransferFailed
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    TokenLogprobs,
    Usage,
)
from services.engines.vllm.logprobs import output_logprobs, prompt_logprobs_of


def finish_reason_of(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    return {
        "stop": FinishReason.STOP,
        "length": FinishReason.LENGTH,
        "abort": FinishReason.ABORT,
    }.get(reason, FinishReason.ERROR)


def error_message(request: DecodeRequest) -> str:
    """What a request vLLM finished with an error is told (vLLM gives no message)."""
    if request.kv_handle is None:
        return "vLLM ended the request with an error"
    return (
        f"vLLM ended the request with an error: loading its KV from "
        f"{request.kv_handle.producer_engine_id} "
        "failed (kv_load_failure_policy=fail; the decode engine's log names the blocks)"
    )


def _usage(prompt_tokens: int, completion_tokens: int, output: Any) -> Usage:
    return Usage(
        prompt_tokens,
        completion_tokens,
        int(output.num_cached_tokens or 0),
        int(output.num_cache_creation_tokens or 0),
    )


def prefill_completion(request_id: str, final: Any) -> Any:
    """The completion of a prefill's last output (its first token), or :class:`EngineFailed`
    when vLLM returned none."""
    if final is None or not final.outputs or not final.outputs[0].token_ids:
        raise EngineFailed(f"vLLM returned no token for {request_id}")
    return final.outputs[0]


def prefill_ended(request: PrefillRequest, completion: Any) -> bool:
    """Whether the prefill's first token ends the request (no decode follows)."""
    return request.sampling.max_tokens == 1 or (
        finish_reason_of(completion.finish_reason) is FinishReason.STOP
    )


def prefill_result(
    request: PrefillRequest,
    final: Any,
    handle: KVHandle | None,
    prompt_logprobs: tuple[TokenLogprobs, ...],
    prefill_s: float,
) -> PrefillResult:
    """The prefill's result from vLLM's last output ``final``; ``handle``: the KV held for a
    consumer, None when the request ended here."""
    completion = prefill_completion(request.request_id, final)
    reason = finish_reason_of(completion.finish_reason)
    firsts = output_logprobs(completion.token_ids, completion.logprobs, request.sampling.logprobs)
    return PrefillResult(
        request_id=request.request_id,
        first_token_id=int(completion.token_ids[-1]),
        text=completion.text,
        kv_handle=handle,
        finish_reason=None if handle is not None else (reason or FinishReason.LENGTH),
        usage=_usage(len(request.prompt_token_ids), 1, final),
        prefill_s=prefill_s,
        logprobs=firsts[-1] if firsts else None,
        prompt_logprobs=prompt_logprobs,
    )


def token_delta(
    request: DecodeRequest,
    output: Any,
    *,
    prompt: list[int],
    prompt_logprobs: int | None,
    produced: int,
    first: bool,
    kv_transfer_s: float | None = None,
) -> TokenDelta:
    """One decode output of vLLM as a :class:`TokenDelta`: ``prompt`` is what vLLM was given
    (with the producer's first token), ``prompt_logprobs`` how many it was asked for, ``produced``
    the output tokens so far (this output's included), ``first`` whether it is the first output,
    ``kv_transfer_s`` the handoff the first delta reports (the router's handoff phase).

    Raises :class:`KVTransferFailed` when vLLM ended the request before its first token with a
    KV handle: loading the KV failed (kv_load_failure_policy=fail). Raised before any delta, so
    the router re-prefills elsewhere or decodes locally, counted, at once."""
    completion = output.outputs[0]
    reason = finish_reason_of(completion.finish_reason)
    if (
        first
        and reason is FinishReason.ERROR
        and not completion.token_ids
        and request.kv_handle is not None
    ):
        raise KVTransferFailed(error_message(request), "vllm_kv_load_failed")
    return TokenDelta(
        token_ids=tuple(int(t) for t in completion.token_ids),
        text=completion.text,
        finish_reason=reason,
        error=error_message(request) if reason is FinishReason.ERROR else None,
        usage=_usage(len(request.prompt_token_ids), produced, output) if reason else None,
        kv_transfer_s=kv_transfer_s,
        cached_tokens=(
            int(output.num_cached_tokens or 0) if first and request.kv_handle is None else None
        ),
        logprobs=output_logprobs(
            completion.token_ids, completion.logprobs, request.sampling.logprobs
        ),
        prompt_logprobs=(
            prompt_logprobs_of(prompt, output.prompt_logprobs, prompt_logprobs) if first else ()
        ),
    )
