"""Incremental detokenization with stop strings: the one rule for the text a request releases.

Torch-free, so the router (which continues a migrated request's text with the same rule,
services/router/execution/migration.py) uses it as the reference engine does, without importing the
engine. Re-exported by :mod:`services.engines.reference.sampling`.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.tokenization.tokenizer import Tokenizer


class OutputText:
    """Incremental detokenization of one request's output with stop-string handling.

    :meth:`add` takes the output tokens so far and returns the text that may be released now.
    Text is held back while it ends in an incomplete UTF-8 character (``U+FFFD``) or in a
    prefix of a stop string; once a stop string appears, the text before it is released and
    :attr:`stopped` turns true (the stop string itself is never released).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Iterable[str],
        *,
        already_released: Iterable[int] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """``already_released``: tokens another engine already added (a producer's first token).
        They are replayed through :meth:`add`, so text it held back (an incomplete character, a
        possible stop-string prefix) is released here exactly as a colocated engine would."""
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        """Stop strings count only once more than this many tokens were added (vLLM's rule)."""
        self._ids: list[int] = []
        self._released = 0
        self.stopped = False
        self.text = ""
        for token_id in already_released:
            self.add(token_id)
        self.text = ""
        """Everything released so far (excluding what the replayed tokens released)."""

    def _text(self) -> str:
        return self._tokenizer.decode(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; the newly releasable text."""
        self._ids.append(token_id)
        full = self._text()
        checking = len(self._ids) > self._min_tokens
        for stop in self._stop if checking else ():
            at = full.find(stop, max(self._released - len(stop) + 1, 0))
            if at != -1:
                self.stopped = True
                return self._release(full, at + len(stop) if self._include_stop else at)
        end = len(full)
        while end > self._released and full[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, end - self._released), 0, -1):
                if full[end - length : end] == stop[:length]:
                    hold = max(hold, length)
                    break
        return self._release(full, end - hold)

    def flush(self, *, incomplete: bool = True) -> str:
        """At the end of the request: release whatever was held back (no stop string came);
        with ``incomplete`` false, except a trailing incomplete UTF-8 character (vLLM's
        detokenizer never releases one: its text ends before it)."""
        if self.stopped:
            return ""
        full = self._text()
        end = len(full)
        while not incomplete and end > self._released and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full, end)

    def _release(self, full: str, end: int | None) -> str:
        stop_at = len(full) if end is None else end
        if stop_at <= self._released:
            return ""
        piece = full[self._released : stop_at]
        self._released = stop_at
        self.text += piece
        return piece
