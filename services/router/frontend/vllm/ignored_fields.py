"""Request fields vLLM's front end ignores: counted, and each name logged once.

vLLM's protocol models accept a field they do not know and ignore it, as vLLM's server does
(``OpenAIBaseModel.__log_extra_fields__`` in ``vllm/entrypoints/serve/engine/protocol.py``,
which logs the names at DEBUG on that module's logger). pdserve reads that record rather than
parsing bodies a second time: :class:`IgnoredFields`, a filter on vLLM's logger, counts the
names in ``pdserve_router_ignored_fields_total{field}`` of the router serving the request (the
:class:`~.engine_client.HttpRequestRuns` in :data:`~.engine_client.REQUEST_RUNS`), logs the
names that router never saw before at WARNING, and drops vLLM's DEBUG record. The logger is
set to DEBUG so that vLLM makes the record; the filter lets through only what the logger's
level let through before.
"""

from __future__ import annotations

import logging
from typing import Any

from services.router.frontend.vllm.engine_client import REQUEST_RUNS

logger = logging.getLogger(__name__)

PROTOCOL_LOGGER = "vllm.entrypoints.serve.engine.protocol"
"""The logger of vLLM's ``OpenAIBaseModel``."""

IGNORED_MESSAGE = "The following fields were present in the request but ignored: %s"
"""vLLM 0.32's record of a request's unknown fields (its one argument: their names)."""


class IgnoredFields(logging.Filter):
    """See the module docstring. ``level``: the logger's effective level before."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != IGNORED_MESSAGE or not record.args:
            return record.levelno >= self.level
        runs = REQUEST_RUNS.get()
        if runs is not None and runs.metrics is not None:
            fields: Any = record.args[0]  # type: ignore[index]  # (a tuple: vLLM's one argument)
            names = sorted(str(name) for name in fields)
            new = runs.metrics.ignored(names)
            if new:
                logger.warning(
                    "request fields ignored, as vLLM's server ignores them (counted in "
                    "pdserve_router_ignored_fields_total; logged once): %s",
                    ", ".join(new),
                )
        return False


def count_ignored_fields() -> None:
    """Install :class:`IgnoredFields` on vLLM's protocol logger (once per process)."""
    protocol = logging.getLogger(PROTOCOL_LOGGER)
    if any(isinstance(installed, IgnoredFields) for installed in protocol.filters):
        return
    protocol.addFilter(IgnoredFields(protocol.getEffectiveLevel()))
    protocol.setLevel(logging.DEBUG)
