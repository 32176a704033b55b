"""A ``pdserve up`` that a benchmark starts: the folder it runs in (:func:`work_root`), the
endpoints it writes once ready (:func:`wait_endpoints`), and the model its router serves
(:func:`served_model`)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from services.supervision import ChildExited, DetachedProcess


@contextlib.contextmanager
def work_root(work_dir: Path | None, bench: str) -> Iterator[Path]:
    """``--work-dir``, or a temporary folder ``pdserve-<bench>-*`` removed at the end."""
    if work_dir is not None:
        yield work_dir
        return
    with tempfile.TemporaryDirectory(prefix=f"pdserve-{bench}-") as temporary:
        yield Path(temporary)


def wait_endpoints(up: DetachedProcess, work_dir: Path, timeout_s: float) -> dict[str, Any]:
    path = work_dir / "endpoints.json"
    try:
        up.wait_for_file(path, timeout_s)
    except (ChildExited, TimeoutError):
        tail = up.output()[-3000:]
        raise RuntimeError(f"pdserve up did not become ready:\n{tail}") from None
    endpoints: dict[str, Any] = json.loads(path.read_text())
    return endpoints


def served_model(router: str) -> str:
    """The first model the router at ``router`` lists."""
    return str(httpx.get(f"{router}/v1/models", timeout=30).json()["data"][0]["id"])
