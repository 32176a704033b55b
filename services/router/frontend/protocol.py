"""OpenAI request models (pydantic, at the HTTP edge) and the response bodies.

The request models declare every field of vLLM 0.32's OpenAI server
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``) with vLLM's defaults, so
a request that a vLLM client fills with defaults (``"repetition_penalty": 1.0``,
``"logprobs": null``...) is accepted. Fields pdserve carries to the engines (sampling, logprobs,
``n``, ``echo``...) are typed; the vLLM extensions pdserve does not implement are declared in
:data:`NEUTRAL_EXTENSIONS` and accepted only at their default value (a 400 naming the
parameter otherwise, never silently ignored). Fields vLLM's server does not know either
(``best_of``, removed ones such as ``guided_json``, any other) are ignored as vLLM ignores
them, and logged and counted (:func:`ignored_fields`). Whether an
engine can honour a carried parameter is checked against the engines' kinds
(:mod:`services.router.frontend.params`). Responses are plain dicts (no response validation on the
hot path).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from services.engines.backend import MAX_LOGPROBS, MAX_STOP_STRINGS, FinishReason

MAX_PROMPT_TOKEN_IDS = 1_000_000
MAX_BATCH_PROMPTS = 64
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**32)]


StreamUsage = Literal["none", "final", "continuous"]
"""What a stream says of usage: nothing; a last chunk with ``usage`` (and no choices) before
``[DONE]`` (``include_usage``); or that and, on every chunk, the usage so far (vLLM's
``continuous_usage_stats``, which counts only with ``include_usage``)."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk also carries the usage so far."""

    def usage(self) -> StreamUsage:
        if not self.include_usage:
            return "none"
        return "continuous" if self.continuous_usage_stats else "final"


REMOVED_GUIDED_FIELDS = frozenset(
    {
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)
"""Guided-decoding fields vLLM removed (its server ignores them with a warning: the output is
NOT constrained; ``structured_outputs`` or ``response_format`` replace them)."""


def ignored_fields(body: BaseModel) -> list[str]:
    """The request's fields the server does not know, ignored as vLLM's server ignores them
    (top level and ``stream_options``)."""
    names = list(body.model_extra or ())
    options = getattr(body, "stream_options", None)
    if isinstance(options, BaseModel) and options.model_extra:
        names += [f"stream_options.{name}" for name in options.model_extra]
    return names


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """A chunk's usage so far (``continuous_usage_stats``), as vLLM writes it."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


NEUTRAL_EXTENSIONS: dict[str, Any] = {
    "use_beam_search": False,
    "watermarking": None,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "truncation_side": None,
    "allowed_token_ids": None,
    "logprob_token_ids": None,
    "bad_words": [],
    "prompt_embeds": None,
    "response_format": None,
    "structured_outputs": None,
    "priority": 0,
    "return_tokens_as_token_ids": None,
    "return_token_ids": None,
    "routed_experts_prompt_start": 0,
    "return_token_offsets": False,
    "mm_payload": "tensors",
    "return_mm_kwargs": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
    "stream_interval": None,
    # chat only
    "tools": None,
    "tool_choice": "none",
    "reasoning_effort": None,
    "include_reasoning": True,
    "parallel_tool_calls": True,
    "continue_final_message": False,
    "documents": None,
    "chat_template": None,
    "chat_template_kwargs": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "return_prompt_text": None,
}
"""vLLM request fields pdserve does not implement, with vLLM's defaults: accepted only at the
default (``response_format`` also as ``{"type": "text"}``). ``request_id`` and ``session_id``
are accepted and ignored (pdserve names its own requests)."""

_CHAT_ONLY = {
    "tools",
    "tool_choice",
    "reasoning_effort",
    "include_reasoning",
    "parallel_tool_calls",
    "continue_final_message",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "return_prompt_text",
}


def _neutral_problem(body: BaseModel, names: list[str]) -> tuple[str, str] | None:
    given = body.model_fields_set  # a field the request left out holds its default
    for name in names:
        if name not in given:
            continue
        value = getattr(body, name)
        default = NEUTRAL_EXTENSIONS[name]
        if value == default or (value is None and default in ([], False)):
            continue
        if name == "response_format" and value == {"type": "text"}:
            continue
        if name == "tool_choice" and value in ("none", "auto") and not body.tools:  # type: ignore[attr-defined]
            continue
        return name, f"{name} is not supported by pdserve (only its default {default!r})"
    return None


@functools.cache
def _neutral_names(model: type[BaseModel]) -> list[str]:
    """The :data:`NEUTRAL_EXTENSIONS` that ``model`` declares, chat-only ones aside (once per
    class: ``model_fields`` is a computed property, read per name it showed per request)."""
    return [n for n in NEUTRAL_EXTENSIONS if n not in _CHAT_ONLY and n in model.model_fields]


class _SamplingFields(BaseModel):
    """Fields common to completions and chat completions (vLLM's names and defaults). A field
    vLLM's server does not know either is ignored, as vLLM ignores it (``extra="allow"``; the
    router logs and counts it: :func:`ignored_fields`)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=1_000_000)
    """vLLM's extension: -1 or 0 disables it."""
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    """vLLM's extension: end on these ids."""
    ignore_eos: bool = False
    """vLLM's extension: do not stop at EOS."""
    n: StrictInt = Field(default=1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    min_tokens: StrictInt = Field(default=0, ge=0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool | None = None
    """Completions: default true; chat: default false (the template adds them)."""
    user: StrictStr | None = Field(default=None, max_length=256)
    """Accepted and ignored (an end-user id for abuse monitoring)."""
    request_id: StrictStr | None = Field(default=None, max_length=256)
    session_id: StrictStr | None = Field(default=None, max_length=256)

    # vLLM extensions accepted only at their default (NEUTRAL_EXTENSIONS).
    use_beam_search: bool = False
    watermarking: Any = None
    length_penalty: Any = 1.0
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    allowed_token_ids: Any = None
    logprob_token_ids: Any = None
    bad_words: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    priority: Any = 0
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    routed_experts_prompt_start: Any = 0
    return_token_offsets: Any = False
    mm_payload: Any = "tensors"
    return_mm_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first parameter set to a value the router does not
        implement (or that vLLM refuses in this combination), or ``None``."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "Stream options can only be defined when `stream=True`."
        if self.prompt_logprobs and self.stream:
            return "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
        return _neutral_problem(self, _neutral_names(type(self)))

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings")
        return self


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string or a list of token ids (one prompt)."""

    prompt: StrictStr | list[TokenId] | list[StrictStr] | list[list[TokenId]]
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=1_000_000)
    """``None`` reads as 16; 0 only with ``echo`` (score the prompt, generate nothing)."""
    echo: bool | None = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = None
    prompt_embeds: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_length(cls, value: object) -> object:
        """At most :data:`MAX_PROMPT_TOKEN_IDS` token ids per prompt, checked before the union
        is tried (each of its members would otherwise walk, and report on, every item)."""
        prompts: list[object] = [value]
        if isinstance(value, list) and value and isinstance(value[0], list):
            prompts = value
        for prompt in prompts:
            if (
                isinstance(prompt, list)
                and len(prompt) > MAX_PROMPT_TOKEN_IDS
                and not isinstance(prompt[0], str)
            ):
                raise ValueError(f"at most {MAX_PROMPT_TOKEN_IDS} prompt token ids")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported"
        if self.prompt_embeds is not None:
            return "prompt_embeds", "prompt_embeds is not supported by pdserve"
        if len(self.prompts()) > MAX_BATCH_PROMPTS:
            return "prompt", f"at most {MAX_BATCH_PROMPTS} prompts per request"
        return super().unsupported()

    def prompts(self) -> list[str | list[int]]:
        """The prompts (text or token ids); several for a batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            return [[]]
        first = prompt[0]
        if isinstance(first, int):
            return [[int(token) for token in prompt if isinstance(token, int)]]
        prompts: list[str | list[int]] = []
        for item in prompt:
            if isinstance(item, str):
                prompts.append(item)
            elif isinstance(item, list):
                prompts.append(list(item))
        return prompts

    def single_prompt(self) -> str | list[int]:
        """The first prompt (text or token ids)."""
        return self.prompts()[0]


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = Field(default=None, max_length=256)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    logprobs: bool | None = False
    top_logprobs: StrictInt | None = Field(default=0, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    """vLLM's extension: end the rendered prompt with the assistant header."""
    echo: bool = False
    tools: Any = None
    tool_choice: Any = "none"
    reasoning_effort: Any = None
    include_reasoning: Any = True
    parallel_tool_calls: Any = True
    continue_final_message: Any = False
    documents: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
        if self.echo:
            return "echo", "echo is not supported by pdserve on chat completions"
        problem = _neutral_problem(self, sorted(_CHAT_ONLY))
        return problem or super().unsupported()


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now_s() -> int:
    return int(time.time())


SSE_DONE = b"data: [DONE]\n\n"
"""The server-sent event that ends every OpenAI stream."""


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def finish_text(finish: FinishReason | None) -> str | None:
    """The OpenAI ``finish_reason`` of an engine's finish reason."""
    if finish is None:
        return None
    if finish in (FinishReason.STOP, FinishReason.LENGTH):
        return finish.value
    return "abort" if finish is FinishReason.ABORT else "error"
