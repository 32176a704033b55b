"""Prompts to token ids without holding up the event loop (pdserve's own front end).

Tokenizing a 6 MB prompt takes seconds; on the event loop, every other request of the process
waits that long. So:

- **Short prompts** (at most :data:`INLINE_CHARS` characters, rendered chat included) are
  tokenized on the loop: a thread hop would cost more than the encoding (tens of microseconds).
- **Long ones** go to a bounded pool of ``tokenize_workers`` threads. HF ``tokenizers`` releases
  the GIL while it encodes a batch (``HFTokenizer`` encodes long texts as a batch of one), so the
  loop keeps running; the chat template is rendered in the same thread. At most
  ``tokenize_queue`` long prompts wait for or run in the pool per process: one more is answered
  429 (:class:`~services.router.errors.TooManyRequests`).
- **A prompt over the context** is refused from a bounded prefix: when a long prompt has more
  than :data:`PREFIX_CHARS_PER_TOKEN` characters per token of context, its first ``context x``
  that many characters are tokenized first, and if they alone exceed the context by
  :data:`CUT_TOKENS` (what cutting a word may add), the request is refused without tokenizing the
  rest. Otherwise the whole prompt is tokenized and checked as before (vLLM's message).

The body-size bound comes before all of this (``direct_route``: 413 before the JSON is parsed),
and a large body (over :data:`INLINE_BODY_BYTES`) is parsed and validated in the same pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.router.errors import InvalidRequestError, TooManyRequests
from services.router.frontend.chat import ChatRenderer
from services.router.frontend.protocol import ChatMessage
from services.tokenization.tokenizer import Tokenizer

T = TypeVar("T")

INLINE_CHARS = 8192
"""Prompts up to this many characters are tokenized on the event loop (well under a
millisecond)."""
INLINE_BODY_BYTES = 65536
"""Request bodies up to this size are parsed on the event loop (pydantic-core: well under a
millisecond); larger ones in the pool (a 6 MB body takes tens of milliseconds)."""
PREFIX_CHARS_PER_TOKEN = 32
"""Characters per token of context tokenized first for a long prompt: a token covers fewer
characters than this in any text a model reads (a run of spaces may be one token: then the
whole prompt is tokenized, as without the rule)."""
CUT_TOKENS = 16
"""Tokens that cutting a prompt mid-word may add to its prefix's count (a word split in two
tokenizes into at most a few more pieces)."""


class PromptTokenizer:
    """Token ids of completion and chat prompts; see the module docstring."""

    def __init__(
        self, tokenizer: Tokenizer, chat: ChatRenderer, *, workers: int, queue: int
    ) -> None:
        self._tokenizer = tokenizer
        self._chat = chat
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pdserve-tokenize")
        self._queue = queue
        self._waiting = 0
        """Long prompts handed to the pool and not finished."""

    @property
    def waiting(self) -> int:
        """Long prompts in the pool now (waiting or being tokenized)."""
        return self._waiting

    async def completion(
        self, text: str, *, add_special_tokens: bool, context: int | None
    ) -> list[int]:
        """Token ids of a completion prompt; a prompt whose prefix alone exceeds ``context``
        (``None``: unknown) raises :class:`InvalidRequestError`."""
        if len(text) <= INLINE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self.offload(
            functools.partial(self._bounded, text, add_special_tokens, context)
        )

    async def chat(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool,
        context: int | None,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes the model's framing, so
        no special tokens are added, except with the default template)."""
        size = sum(len(message.text()) for message in messages)
        if size <= INLINE_CHARS:
            return self._chat.tokenize(messages, add_generation_prompt=add_generation_prompt)

        def render_and_encode() -> list[int]:
            text = self._chat.render(messages, add_generation_prompt=add_generation_prompt)
            return self._bounded(text, self._chat.adds_special_tokens, context)

        return await self.offload(render_and_encode)

    def _bounded(self, text: str, add_special_tokens: bool, context: int | None) -> list[int]:
        """In a pool thread: the prefix check, then the whole prompt."""
        if context:
            cut = context * PREFIX_CHARS_PER_TOKEN
            if len(text) > cut:
                counted = len(self._tokenizer.encode(text[:cut], add_special_tokens=False))
                if counted > context + CUT_TOKENS:
                    raise InvalidRequestError(
                        f"This model's maximum context length is {context} tokens. However, "
                        f"your prompt contains more than {counted - CUT_TOKENS} input tokens "
                        f"(its first {cut} of {len(text)} characters alone), which exceeds "
                        "this limit even without any output tokens. Please reduce the length "
                        "of the input prompt.",
                        param="input_tokens",
                    )
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def offload(self, work: Callable[[], T]) -> T:
        """``work`` in the pool (a long prompt's tokenizing, a large body's parsing); counted
        from submission until the thread is done with it (a client that left does not free its
        place while its prompt is still being encoded)."""
        if self._waiting >= self._queue:
            raise TooManyRequests(
                f"{self._waiting} long prompts are being tokenized by this router process "
                f"(PDSERVE_ROUTER_TOKENIZE_QUEUE={self._queue}); retry shortly"
            )
        loop = asyncio.get_running_loop()
        self._waiting += 1
        future = self._pool.submit(work)
        future.add_done_callback(lambda _: _call_soon(loop, self._finished))
        return await asyncio.wrap_future(future, loop=loop)

    def _finished(self) -> None:
        self._waiting -= 1

    def close(self) -> None:
        """Stop the threads (a prompt being tokenized finishes first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """``callback`` on ``loop`` from a pool thread (nothing once the loop is closed)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
