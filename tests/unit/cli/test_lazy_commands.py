"""The ``pdserve`` parser stays light: torch, NIXL and the reference engine are imported only by
the commands that use them (``pdserve status`` must start fast, e.g. before a lease expires)."""

from __future__ import annotations

import subprocess
import sys

from services.cli.main import build_parser


def test_building_the_parser_imports_no_engine_or_torch() -> None:
    probe = (
        "import sys; from services.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'nixl', 'services.engines.reference.backend') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_bench_flags_are_parsed_by_the_chosen_benchmark() -> None:
    args, unparsed = build_parser().parse_known_args(
        ["bench", "control-plane", "--engines", "3", "--redis", "redis://h:1"]
    )
    assert args.bench == "control-plane"
    from services.cli import bench  # noqa: PLC0415

    full = bench.benchmark_parser(bench._BY_NAME["control-plane"]).parse_args(unparsed)
    assert full.engines == "3" and full.redis == "redis://h:1"  # a comma list, parsed later
