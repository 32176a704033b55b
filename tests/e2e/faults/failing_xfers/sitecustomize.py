"""Fault injection for the vLLM PD tests: NIXL transfers that fail at submission, on demand.

A stack started with this folder on ``PYTHONPATH`` and ``PDSERVE_TEST_FAIL_XFERS_FILE=PATH``
loads this module in every Python process it starts (vLLM's spawned workers included). While
``PATH`` exists, every NIXL transfer of the operations it names (``WRITE`` for pushes, ``READ``
for pulls, one per line) fails when it is submitted: ``nixl_agent.make_prepped_xfer`` raises, as
it does for a peer whose agent went away. Everything else in the engines is the real path; with
no such file, nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_FLAG = os.environ.get("PDSERVE_TEST_FAIL_XFERS_FILE")


def _install(flag: Path) -> None:
    # Imported only when injecting: the other tests load no NIXL in, e.g., the router.
    from nixl._api import nixl_agent  # noqa: PLC0415  (the class vLLM's NixlWrapper is)

    submit = nixl_agent.make_prepped_xfer

    def make_prepped_xfer(self: Any, operation: str, *args: Any, **kwargs: Any) -> Any:
        try:
            failing = flag.read_text().split()
        except FileNotFoundError:
            failing = []
        if operation in failing:
            raise RuntimeError(f"injected {operation} failure ({flag} names it)")
        return submit(self, operation, *args, **kwargs)

    nixl_agent.make_prepped_xfer = make_prepped_xfer


if _FLAG:
    _install(Path(_FLAG))
