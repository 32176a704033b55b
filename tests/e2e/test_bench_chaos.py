"""A small ``pdserve bench chaos``: a decode rank killed under load through ``pdserve up``
with two prefill and two decode engines loses no request, and the JSON says what moved."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.bench import chaos

pytestmark = [pytest.mark.e2e, pytest.mark.destructive, pytest.mark.slow]


def test_chaos_loses_no_request_and_reports_the_migrations(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--work-dir", str(tmp_path), "--requests", "60", "--concurrency", "8"),
            *("--faults", "kill-decode", "--idle-timeout-s", "30"),
        ]
    )
    result = chaos.run(args)
    assert result["requests"] == 60
    assert result["failed"] == 0, result["failed_samples"]
    (fault,) = result["faults"]
    assert fault["fault"] == "kill-decode" and fault["target_busy"], fault
    # decode-0 had requests in flight when its rank died: they moved, and the client saw it.
    assert result["migrated"] >= 1
    assert sum(result["migrations"].values()) >= result["migrated"]
    assert result["e2e_ms"]["migrated"]["count"] == result["migrated"]
    assert result["migration_added_ms"] is not None
