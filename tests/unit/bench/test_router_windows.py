"""``pdserve bench router``: a window that completed no request, or whose CPU readings missed
it, is run again, longer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from services.bench import router_load


def _entry(latencies: list[int], errors: int = 0, coverage: float | None = 1.0) -> dict[str, Any]:
    return {"_latencies_us": latencies, "errors": errors, "cpu_coverage": coverage}


@pytest.mark.parametrize(
    ("windows", "lasted"),
    [
        ([_entry([]), _entry([900])], [1.0, 2.0]),  # nothing completed: once more, twice as long
        ([_entry([]), _entry([]), _entry([])], [1.0, 2.0, 4.0]),  # at most three windows
        ([_entry([], errors=2)], [1.0]),  # failures are a result: not run again
        ([_entry([700])], [1.0]),
        # The bench woke after the window: its CPU readings missed it (the router read idle)
        ([_entry([700], coverage=None), _entry([800])], [1.0, 2.0]),
    ],
)
async def test_an_empty_window_is_run_again_twice_as_long(
    monkeypatch: pytest.MonkeyPatch, windows: list[dict[str, Any]], lasted: list[float]
) -> None:
    asked: list[float] = []
    results = iter(windows)

    async def window(
        target: object, connections: int, duration_s: float, *rest: object
    ) -> dict[str, Any]:
        asked.append(duration_s)
        return dict(next(results))

    monkeypatch.setattr(router_load, "_window", window)
    target: Any = object()
    placement: Any = object()
    entry = await router_load._load(
        target, 8, 1.0, argparse.Namespace(), placement, Path("/nonexistent")
    )
    assert asked == lasted
    assert entry["window_s"] == lasted[-1]


@pytest.mark.parametrize(
    ("read_before", "read_after", "coverage"),
    [
        (10.0, 11.0, 1.0),  # on time
        (10.2, 11.3, 0.8),  # woke 0.2 s late: 80% of the window read
        (10.6, 11.0, None),  # read less than half of it
        (11.2, 11.2, None),  # both readings after the window: the 0 CPU seen in a loaded run
    ],
)
def test_cpu_coverage_is_the_share_of_the_window_read(
    read_before: float, read_after: float, coverage: float | None
) -> None:
    assert router_load.cpu_coverage(10.0, 11.0, read_before, read_after) == coverage
