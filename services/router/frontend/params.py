"""OpenAI/vLLM request fields -> :class:`SamplingParams`, and the checks that need the pool.

vLLM's defaults apply (``temperature`` 1, ``top_p`` 1, no penalties...). Two checks read the
engines that serve the request's model:

- :func:`check_engines`: a carried parameter an engine kind cannot honour is a 400 naming the
  parameter and the engine (never sent and silently ignored). :data:`ENGINE_UNSUPPORTED` is
  the table; a kind missing from it gets only the parameters every pdserve engine had before
  the sampling fields were added (it may predate them and would ignore them).
- :func:`check_context`: prompt + ``max_tokens`` must fit the context (``max_model_len``) of
  some engine; the message has vLLM's shape. Engines that do not publish their context (0)
  are not checked.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

from services.control_plane.wire import EngineRecord
from services.engines.backend import SamplingParams
from services.router.errors import InvalidRequestError
from services.router.frontend.protocol import ChatCompletionRequest, CompletionRequest

EXTENDED_PARAMS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "structured_outputs",
)
"""The SamplingParams fields added with vLLM's parameters (types.proto fields 9-19, 22)."""

_NEUTRAL = SamplingParams()

ENGINE_UNSUPPORTED: dict[str, frozenset[str]] = {
    "vllm": frozenset(),
    # The reference engine's detokenizer always skips special tokens; it samples
    # unconstrained (no grammar library).
    "reference": frozenset(
        {"skip_special_tokens", "spaces_between_special_tokens", "structured_outputs"}
    ),
    # The stub engine of the router tests samples nothing; nor does the simulated engine.
    "stub": frozenset(EXTENDED_PARAMS),
    "sim": frozenset(EXTENDED_PARAMS),
}

SEED_MASK = 2**63 - 1


def sampling_of(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """The request's sampling parameters with vLLM's defaults for what it leaves out."""
    bias = tuple(
        sorted((_bias_token(key), value) for key, value in (body.logit_bias or {}).items())
    )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=None if body.seed is None else body.seed & SEED_MASK,
        stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens,
        logit_bias=tuple((token, max(-100.0, min(100.0, value))) for token, value in bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
    )


def _bias_token(key: str) -> int:
    try:
        token = int(key)
    except ValueError:
        raise InvalidRequestError(
            f"logit_bias contains key(s) that cannot be converted to token ids: {key!r}",
            param="logit_bias",
        ) from None
    if token < 0:
        raise InvalidRequestError(f"logit_bias: token id {token} is negative", param="logit_bias")
    return token


def plain(sampling: SamplingParams) -> bool:
    """Whether the response needs no logprobs (the single-choice fast path can serve it)."""
    return sampling.logprobs is None and sampling.prompt_logprobs is None


_extended_values = operator.attrgetter(*EXTENDED_PARAMS)
_NEUTRAL_VALUES = _extended_values(_NEUTRAL)


def non_default(sampling: SamplingParams) -> list[str]:
    """The extended fields ``sampling`` sets to something other than their default."""
    values = _extended_values(sampling)
    if values == _NEUTRAL_VALUES:  # most requests: one C-level read and compare
        return []
    return [
        name
        for name, value, neutral in zip(EXTENDED_PARAMS, values, _NEUTRAL_VALUES, strict=True)
        if value != neutral
    ]


def check_engines(records: Iterable[EngineRecord], sampling: SamplingParams) -> None:
    """400 when an engine that may serve the request cannot honour one of its parameters."""
    wanted = non_default(sampling)
    if not wanted:
        return
    for record in records:
        unsupported = ENGINE_UNSUPPORTED.get(record.engine_kind, frozenset(EXTENDED_PARAMS))
        for name in wanted:
            if name in unsupported:
                raise InvalidRequestError(
                    f"{name}={getattr(sampling, name)!r} is not supported by engine "
                    f"{record.engine_id} ({record.engine_kind} engine)",
                    param=name,
                    code="unsupported_parameter",
                )


def context_limit(records: Iterable[EngineRecord]) -> int | None:
    """The largest context among ``records`` (a request that fits it fits one of them);
    ``None`` when there is no engine or one does not report its context."""
    lengths = [record.max_model_len for record in records]
    if not lengths or any(length == 0 for length in lengths):
        return None
    return max(lengths)


def check_context(records: Iterable[EngineRecord], prompt_tokens: int, max_tokens: int) -> None:
    """400 (vLLM's message) when no engine's context holds prompt + ``max_tokens``."""
    limit = context_limit(records)
    if limit is None:
        return
    if max_tokens > limit:
        raise InvalidRequestError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens.",
            param="max_tokens",
        )
    if prompt_tokens >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    if prompt_tokens + max_tokens > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param="max_tokens",
        )
