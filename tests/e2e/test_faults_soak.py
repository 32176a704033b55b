"""A small ``pdserve bench soak``: sustained streaming load through ``pdserve up`` loses no
request and does not grow memory without bound (the big run is the benchmark)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.bench import soak

pytestmark = [pytest.mark.e2e, pytest.mark.destructive, pytest.mark.slow]

RSS_GROWTH_BOUND_MIB = 64.0
"""Total RSS growth of the stack over the measured phase (Python allocators keep some)."""


def soak_args(work_dir: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    return parser.parse_args(["--work-dir", str(work_dir), "--warmup", "16", *flags])


@pytest.mark.parametrize(
    ("engine", "requests"), [("stub", 200), ("reference", 50)], ids=["stub", "reference"]
)
def test_soak_has_no_errors_and_bounded_memory_growth(
    tmp_path: Path, engine: str, requests: int
) -> None:
    args = soak_args(
        tmp_path, "--engine", engine, "--requests", str(requests), "--concurrency", "16"
    )
    result = soak.run(args)
    assert result["requests"] == requests
    assert result["errors"] == 0, result["error_samples"]
    assert result["client_timeouts"] == 0
    assert result["ttft_ms"]["count"] == requests
    assert result["itl_ms"]["count"] > 0
    # ignore_eos: every request generates exactly max_tokens tokens, as usage counts them.
    assert result["tokens"] == requests * result["max_tokens"]
    assert result["paths"].get("disaggregated", 0) > 0
    memory = result["memory"]
    assert memory["processes_gone"] == []
    assert memory["total_growth_mib"] < RSS_GROWTH_BOUND_MIB, memory
    assert result["up_exit_status"] == 0
