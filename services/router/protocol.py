"""OpenAI request models (pydantic, at the HTTP edge) and the response bodies.

Requests forbid unknown fields: a parameter the router does not implement is a 400 naming it,
never silently ignored. Parameters OpenAI defines that the router accepts only at their
neutral value (``n``, ``echo``, ``logprobs``, penalties...) are declared and checked so the
message says exactly what is unsupported. Responses are plain dicts built here (no response
validation on the hot path).
"""

from __future__ import annotations

import time
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

from services.engines.backend import MAX_STOP_STRINGS

MAX_PROMPT_TOKEN_IDS = 1_000_000
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**32)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    """Send a last chunk with ``usage`` (and no choices) before ``[DONE]``."""


class _SamplingFields(BaseModel):
    """Fields common to completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=1_000_000)
    """vLLM's extension: -1 or 0 disables it."""
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    """vLLM's extension: end on these ids."""
    ignore_eos: bool = False
    """vLLM's extension: do not stop at EOS."""
    n: StrictInt = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = Field(default=None, max_length=256)
    """Accepted and ignored (an end-user id for abuse monitoring)."""

    def unsupported(self) -> tuple[str, str] | None:
        """``(param, message)`` for the first parameter set to a value the router does not
        implement, or ``None``."""
        if self.n != 1:
            return "n", "n > 1 is not supported: send one request per choice"
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported (only 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None

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
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=1_000_000)
    echo: bool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    best_of: StrictInt | None = Field(default=None, ge=1, le=128)
    suffix: StrictStr | None = None

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
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        prompt = self.prompt
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        if batched and len(prompt) != 1:
            return "prompt", "batched prompts are not supported: send one per request"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            return []
        first = prompt[0]
        if isinstance(first, list):
            return list(first)
        if isinstance(first, str):
            return first
        return [int(token) for token in prompt if isinstance(token, int)]


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
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    """vLLM's extension: end the rendered prompt with the assistant header."""

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs is not supported"
        return super().unsupported()


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now_s() -> int:
    return int(time.time())
