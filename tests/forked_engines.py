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
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineBackend
from services.engines.standalone import registered_engine

B = TypeVar("B", bound=EngineBackend)


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


@contextlib.asynccontextmanager
async def registered_forking(
    settings: ControlPlaneSettings,
    backend: B,
    *,
    engine_id: str,
    role: EngineRole,
    ready_timeout_s: float,
) -> AsyncIterator[B]:
    """:func:`~services.engines.standalone.registered_engine`, its start (where the engine
    forks its processes) under :func:`default_warning_filters`."""
    async with contextlib.AsyncExitStack() as stack:
        with default_warning_filters():
            engine = await stack.enter_async_context(
                registered_engine(
                    settings,
                    backend,
                    engine_id=engine_id,
                    role=role,
                    ready_timeout_s=ready_timeout_s,
                )
            )
        yield engine
