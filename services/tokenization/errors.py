"""Errors of :mod:`services.tokenization`.

:class:`TokenizerError` is also ``services.engines.errors.TokenizerError`` (re-exported there,
as the router's HTTP error handler names it). A checkpoint's unreadable tokenizer files are
:class:`TokenizerFilesError`; the reference engine reports them as its ``CheckpointError``.
"""

from __future__ import annotations


class TokenizationError(Exception):
    """Base of every error raised by ``services.tokenization``."""


class TokenizerError(TokenizationError, ValueError):
    """Token ids a tokenizer cannot decode; request-scoped."""


class TokenizerFilesError(TokenizationError):
    """A tokenizer file that is present cannot be read or does not match (``eos_token``)."""
