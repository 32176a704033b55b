"""Correct streamed text for a decode that continues after the producer's first token.

A disaggregated decode gives vLLM the prompt plus the token the prefill engine already sampled,
so vLLM's detokenizer (``FastIncrementalDetokenizer``, in the process hosting ``AsyncLLM``)
primes ``tokenizers.decoders.DecodeStream(ids=prompt)`` with a prompt that may end in the
middle of a UTF-8 character (the first token's bytes are only part of one). tokenizers 0.23's
native priming then leaves the stream without a prefix, and its next ``step`` returns the text
of the whole prompt: the decode's first chunk repeats the prompt (seen through pdserve's
router). Priming by stepping through the tail of the prompt, as tokenizers does for generated
tokens, keeps the prefix right. :class:`PrimedDecodeStream` does that when the prompt's text
ends incomplete and uses the native priming otherwise; :func:`install` puts it where vLLM's
detokenizer looks it up (``tokenizers.decoders.DecodeStream``, read at each request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tokenizers.decoders

REPLACEMENT_CHARACTER = "\ufffd"
PRIMING_TAIL = 32
"""Prompt tokens stepped through when priming by steps: far more than one character spans."""

_NativeDecodeStream: Any = tokenizers.decoders.DecodeStream


class PrimedDecodeStream:
    """``tokenizers.decoders.DecodeStream`` whose priming survives a prompt ending mid-character.

    Same constructor and ``step`` as the original (the two vLLM uses); the stream is built at the
    first ``step``, when the tokenizer is known.
    """

    def __init__(
        self, ids: Sequence[int] | None = None, skip_special_tokens: bool = False, **kw: Any
    ) -> None:
        self._prompt = list(ids or ())
        self._skip_special_tokens = skip_special_tokens
        self._extra = kw
        self._stream: Any = None

    def _build(self, tokenizer: Any) -> Any:
        tail = self._prompt[-PRIMING_TAIL:]
        text = tokenizer.decode(tail[-4:], skip_special_tokens=self._skip_special_tokens)
        if not tail or not text.endswith(REPLACEMENT_CHARACTER):
            return _NativeDecodeStream(
                ids=self._prompt or None,
                skip_special_tokens=self._skip_special_tokens,
                **self._extra,
            )
        stream = _NativeDecodeStream(skip_special_tokens=self._skip_special_tokens, **self._extra)
        for token_id in tail:  # their text belongs to the prompt: discarded
            stream.step(tokenizer, token_id)
        return stream

    def step(self, tokenizer: Any, token_id: int) -> str | None:
        if self._stream is None:
            self._stream = self._build(tokenizer)
        result: str | None = self._stream.step(tokenizer, token_id)
        return result


def install() -> None:
    """Make vLLM's detokenizer in this process use :class:`PrimedDecodeStream` (idempotent)."""
    tokenizers.decoders.DecodeStream = PrimedDecodeStream  # type: ignore[misc,assignment]
