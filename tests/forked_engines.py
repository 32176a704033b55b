"""Engines a test builds in its own process may fork their processes (vLLM's engine core and
workers, the reference engine's ranks) as engine hosts do: ``tests/conftest.py`` keeps torch on
one thread in every test process, so there is no OpenMP pool for a child to inherit broken.

What a forked child does inherit is the test's warning filters, and pytest's ``error`` filter
would turn vLLM's own warnings (``torch.frombuffer`` on a read-only buffer in its PP send, say)
into engine failures. A spawned process starts with Python's defaults; so does a child forked
inside :func:`default_warning_filters`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def default_warning_filters() -> Iterator[None]:
    """Python's default warning filters while an engine forks its processes; the test's own
    filters again afterwards."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning):
            warnings.simplefilter("ignore", category)
        warnings.simplefilter("ignore", ResourceWarning)
        yield
