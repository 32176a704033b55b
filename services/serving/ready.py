"""The ``PDSERVE_READY`` line: how a pdserve process announces that it serves.

Engines (:mod:`services.serving.host.engine_host`) and the router (:mod:`services.router.main`)
print one line ``PDSERVE_READY {json}`` on stdout once they accept requests; ``pdserve up``, the
benchmarks and the tests wait for it. This module is the one definition of that format and of the
command line that runs a pdserve subcommand; it imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ServingEndpoints:
    """What an engine's ready line announces (:mod:`services.serving.host.engine_host` prints
    it)."""

    engine_id: str
    generation: int
    grpc: str
    metrics: str | None

    def ready_line(self) -> str:
        return format_ready_line(dataclasses.asdict(self))

    @classmethod
    def from_payload(cls, data: dict[str, Any]) -> ServingEndpoints:
        """The endpoints of an engine's ready-line payload (:func:`parse_ready_line`); raises
        ``KeyError``/``ValueError`` for a payload that is not an engine's."""
        return cls(
            engine_id=str(data["engine_id"]),
            generation=int(data["generation"]),
            grpc=str(data["grpc"]),
            metrics=None if data.get("metrics") is None else str(data["metrics"]),
        )


def pdserve_argv(*arguments: str) -> list[str]:
    """The command line running ``pdserve <arguments>`` with this Python."""
    return [sys.executable, "-m", "services.cli.main", *arguments]
