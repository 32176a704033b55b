"""The ``PDSERVE_READY`` line: how a pdserve process announces that it serves.

Engines (:mod:`services.serving.host`) and the router (:mod:`services.router.main`) print one
line ``PDSERVE_READY {json}`` on stdout once they accept requests; ``pdserve up``, the
benchmarks and the tests wait for it. This module is the one definition of that format and of
the command line that runs a pdserve subcommand; it imports nothing heavy.
"""

from __future__ import annotations

import json
import sys
from typing import Any

READY_PREFIX = "PDSERVE_READY"


def format_ready_line(payload: dict[str, Any]) -> str:
    """``PDSERVE_READY {json}`` (keys sorted), without a newline."""
    return f"{READY_PREFIX} {json.dumps(payload, sort_keys=True)}"


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The payload of a ready line, or ``None`` for any other line (a malformed one included).
    Surrounding whitespace (the newline) is ignored."""
    line = line.strip()
    if not line.startswith(READY_PREFIX + " "):
        return None
    try:
        payload = json.loads(line[len(READY_PREFIX) + 1 :])
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def pdserve_argv(*arguments: str) -> list[str]:
    """The command line running ``pdserve <arguments>`` with this Python."""
    return [sys.executable, "-m", "services.cli.main", *arguments]
