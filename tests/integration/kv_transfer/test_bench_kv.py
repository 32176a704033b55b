"""``pdserve bench kv --quick``: the figures come back, positive and JSON-serialisable."""

from __future__ import annotations

import argparse
import json

import pytest

from services.bench import kv

pytestmark = pytest.mark.integration


def test_quick_bench_reports_positive_figures():
    parser = argparse.ArgumentParser()
    kv.add_arguments(parser)
    result = kv.run(parser.parse_args(["--quick"]))
    json.dumps(result)
    assert result["benchmark"] == "kv"
    assert result["pools_back_to_full"] is True
    assert result["geometry"]["block_bytes"] == 8 * 16 * 128 * 2
    assert result["peer_prepare"]["seconds"] > 0
    assert {r["layout"] for r in result["results"]} == {"contiguous", "scattered"}
    for row in result["results"]:
        assert row["verified"] is True
        assert row["bytes"] == row["blocks"] * 2 * 2 * result["geometry"]["block_bytes"]
        for key in (
            "gbps",
            "memcpy_gbps",
            "memcpy_1thread_gbps",
            "ratio",
            "prep_us_per_request",
            "prep_us_per_1000_blocks",
            "prep_us_per_1000_descriptors",
            "prep_us_in_pull",
        ):
            assert row[key] > 0, key
