"""pdserve's engine requests in vLLM's terms and back: sampling parameters for the prefill and
the decode (:func:`prefill_sampling`, :func:`decode_sampling`: the fields as
:mod:`services.engines.sampling_fields` maps them, and the ``extra_args`` keys vLLM's workers
read), and the KV handle carried between them (:func:`encode_handle`, :func:`decode_handle`).
vLLM's outputs back in pdserve's terms are :mod:`.outputs`. Imports nothing of vLLM; the
worker-side modules (``output_in_prompt``, ``seeded_draws``) import their keys from here."""

from __future__ import annotations

import json
import time
from typing import Any

from services.engines.errors import (
    EngineFailed,
    UnknownKVHandle,
)
from services.engines.requests import KVHandle, SamplingParams
from services.engines.sampling_fields import vllm_kwargs
from services.engines.vllm.handshake import vllm_engine_id

MAX_HANDLE_EXTRA_BYTES = 64 * 1024
"""The largest ``KVHandle.extra`` (vLLM's ``kv_transfer_params`` as JSON) accepted."""


OUTPUT_IN_PROMPT_ARG = "pdserve_output_in_prompt"
"""``SamplingParams.extra_args`` key: the request's output tokens that vLLM sees as prompt (a
continuation's tokens so far, a disaggregated decode's first token), for
:data:`OUTPUT_IN_PROMPT_PENALTIES` (services/engines/vllm/output_in_prompt.py)."""

GRAMMAR_PREFIX_ARG = "pdserve_grammar_prefix"
"""``SamplingParams.extra_args`` key: output tokens vLLM sees as prompt (as
:data:`OUTPUT_IN_PROMPT_ARG`) that a structured-output request's grammar must accept before its
first sample here (:func:`services.engines.vllm.contracts.advance_grammar`)."""

SAMPLED_TOKENS_ARG = "pdserve_sampled_tokens"
"""``SamplingParams.extra_args`` key: how many tokens of a seeded request were sampled before
vLLM's (earlier legs, the producer's first token): its generator skips as many draws
(services/engines/vllm/seeded_draws.py)."""

OUTPUT_IN_PROMPT_PENALTIES = "services.engines.vllm.output_in_prompt:OutputInPromptPenalties"
"""The logits processor every vLLM engine without speculative decoding is built with
(``logits_processors``; vLLM refuses custom ones with speculative decoding)."""


def _earlier_output(
    sampling: SamplingParams, prompt: tuple[int, ...], produced: tuple[int, ...]
) -> dict[str, Any]:
    """The ``extra_args`` that carry output vLLM sees as prompt: the prompt's last
    ``sampling.output_tokens_in_prompt`` tokens (a continuation's), then ``produced`` (the
    producer's first token of a disaggregated decode)."""
    earlier = sampling.output_tokens_in_prompt
    tokens = (*prompt[len(prompt) - earlier :], *produced) if earlier else produced
    extra: dict[str, Any] = {}
    if tokens and (sampling.frequency_penalty or sampling.presence_penalty):
        extra[OUTPUT_IN_PROMPT_ARG] = list(tokens)
    if tokens and sampling.seed is not None and not sampling.greedy:
        extra[SAMPLED_TOKENS_ARG] = len(tokens)
    if tokens and sampling.structured_outputs:
        extra[GRAMMAR_PREFIX_ARG] = list(tokens)
    return extra


def prefill_sampling(sampling: SamplingParams, prompt: tuple[int, ...]) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments of a prefill of ``prompt``: one token, hand
    the KV off.

    A request of one token ends at the prefill: no handle is returned, so vLLM is not asked to
    hold its blocks for a consumer (it would, for the whole lease). A first token that is EOS is
    only known afterwards: vLLM then holds the blocks until ``kv_lease_s`` runs out. A
    continuation's output in the prompt goes along as :func:`decode_sampling` says."""
    kwargs: dict[str, Any] = {**vllm_kwargs(sampling), "max_tokens": 1}
    kwargs["min_tokens"] = min(sampling.min_tokens, 1)  # vLLM: min_tokens <= max_tokens
    extra = _earlier_output(sampling, prompt, ())
    if sampling.max_tokens > 1:
        extra["kv_transfer_params"] = {"do_remote_decode": True}
    if extra:
        kwargs["extra_args"] = extra
    return kwargs


def decode_sampling(
    sampling: SamplingParams,
    prompt: tuple[int, ...],
    handle: KVHandle | None,
    first_token_id: int | None = None,
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments of a decode of ``prompt``, pulling
    ``handle``'s KV if given.

    The producer already produced the first token, so the decode generates one fewer (and
    needs one fewer for ``min_tokens``); its prompt logprobs came from the producer. vLLM
    sees the producer's token as part of the prompt, and so are a continuation's tokens so
    far (``sampling.output_tokens_in_prompt``): the repetition penalty covers them; for the
    frequency and presence penalties (output only) they go along in ``extra_args``
    (:data:`OUTPUT_IN_PROMPT_ARG`) and :data:`OUTPUT_IN_PROMPT_PENALTIES` counts them as
    output. A seeded request carries :data:`SAMPLED_TOKENS_ARG` (how many of them) so that
    its generator continues after their draws."""
    kwargs = {**vllm_kwargs(sampling), "max_tokens": sampling.max_tokens}
    produced: tuple[int, ...] = ()
    extra: dict[str, Any] = {}
    if handle is not None:
        kwargs["min_tokens"] = max(0, sampling.min_tokens - 1)
        kwargs["prompt_logprobs"] = None
        params = decode_handle(handle)
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        extra["kv_transfer_params"] = params
        kwargs["max_tokens"] = max(1, sampling.max_tokens - 1)
        produced = (first_token_id,) if first_token_id is not None else ()
    extra.update(_earlier_output(sampling, prompt, produced))
    if extra:
        kwargs["extra_args"] = extra
    return kwargs


def encode_handle(
    params: dict[str, Any],
    *,
    engine_id: str,
    generation: int,
    request_id: str,
    num_tokens: int,
    lease_s: float,
) -> KVHandle:
    """The :class:`KVHandle` of a prefilled request from vLLM's ``kv_transfer_params``."""
    blocks = params.get("remote_block_ids") or [[]]
    first_group = blocks[0] if blocks and isinstance(blocks[0], list) else blocks
    extra = json.dumps(params, separators=(",", ":"), sort_keys=True).encode()
    if len(extra) > MAX_HANDLE_EXTRA_BYTES:
        raise EngineFailed(f"vLLM kv_transfer_params of {len(extra)} bytes exceed the handle bound")
    return KVHandle(
        producer_engine_id=engine_id,
        generation=generation,
        request_id=str(params.get("remote_request_id", request_id)),
        block_ids=tuple(int(b) for b in first_group),
        num_tokens=num_tokens,
        lease_expires_at_s=time.time() + lease_s,
        extra=extra,
    )


def decode_handle(handle: KVHandle) -> dict[str, Any]:
    """vLLM's ``kv_transfer_params`` from a handle; :class:`UnknownKVHandle` when not ours."""
    if not handle.extra or len(handle.extra) > MAX_HANDLE_EXTRA_BYTES:
        raise UnknownKVHandle(f"handle {handle.request_id} carries no vLLM kv_transfer_params")
    try:
        params = json.loads(handle.extra)
    except ValueError as exc:
        raise UnknownKVHandle(f"handle {handle.request_id}: invalid kv_transfer_params") from exc
    required = ("remote_engine_id", "remote_request_id", "remote_block_ids", "tp_size")
    if not isinstance(params, dict) or any(key not in params for key in required):
        raise UnknownKVHandle(f"handle {handle.request_id}: kv_transfer_params lack {required}")
    expected = vllm_engine_id(handle.producer_engine_id, handle.generation)
    if params["remote_engine_id"] != expected:
        raise UnknownKVHandle(
            f"handle names {expected} but its params name {params['remote_engine_id']}"
        )
    return params
