"""guidellm (vLLM's benchmark tool) through ``pdserve up`` (reference engine, disaggregated), in
its default mode: streamed chat completions asking ``stream_options.continuous_usage_stats``,
which the router once refused (issue 30: 0 of 120 requests through). Synthetic prompts from the
tiny checkpoint's own tokenizer; nothing is downloaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SHARED_REFERENCE
from tests.e2e.up_system import UpSystem
from tests.e2e.vllm_bench import router_outcomes

# The stack may start first (up to 240 s), then guidellm's own start-up (datasets, pandas,
# torch) is most of its run on a loaded machine.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.xdist_group(SHARED_REFERENCE),
    pytest.mark.timeout(600),
]

MODEL = "tiny-model"
REQUESTS = 20
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 8
GUIDELLM_TIMEOUT_S = 300
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_run(base_url: str, tokenizer: Path, work_dir: Path) -> dict[str, Any]:
    """``guidellm run`` of ``REQUESTS`` synthetic requests, one at a time, with its default
    backend settings (``openai_http``, ``/v1/chat/completions``, ``stream=True``); its JSON
    report. Fails with its output if it exits non-zero or outlives ``GUIDELLM_TIMEOUT_S``."""
    report = work_dir / "benchmarks.json"
    # Synthetic text (Faker, seeded) cut to length with this tokenizer; a fixed output length is
    # sent as max_completion_tokens with ignore_eos.
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
    args = [
        *("--backend", f"kind=openai_http,target={base_url},model={MODEL}"),
        *("--profile", "kind=synchronous"),
        *("--constraint", f"kind=max_requests,count={REQUESTS}"),
        *("--data", data),
        *("--tokenizer", f"kind=huggingface_auto,model={tokenizer}"),
        *("--output", f"kind=json,path={report}"),
        "--disable-console-interactive",
    ]
    env = {key: value for key, value in os.environ.items() if not key.startswith("GUIDELLM__")}
    process = subprocess.Popen(
        [sys.executable, "-m", "guidellm", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=work_dir,
        env={**env, **OFFLINE},
        # Its scheduler's worker processes are in the group, killed with it on a timeout.
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=GUIDELLM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"guidellm still running after {GUIDELLM_TIMEOUT_S}s:\n{output[-4000:]}")
    assert process.returncode == 0, output[-4000:]
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def test_guidellm_default_streaming_run_has_no_failed_request(
    reference_pd: UpSystem, tiny_model_dir: Path, tmp_path: Path
) -> None:
    total_before, ok_before = router_outcomes(reference_pd.url)
    report = guidellm_run(reference_pd.url, tiny_model_dir, tmp_path)
    total, ok = router_outcomes(reference_pd.url)

    (benchmark,) = report["benchmarks"]
    assert benchmark["config"]["backend"]["stream"] is True
    assert benchmark["metrics"]["request_totals"] == {
        "successful": REQUESTS,
        "errored": 0,
        "incomplete": 0,
        "total": REQUESTS,
    }
    requests = benchmark["requests"]["successful"]
    assert len(requests) == REQUESTS
    for request in requests:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"]["continuous_usage_stats"] is True
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, request["output"]
    # The router's count too: it saw every request, and answered each one in full.
    assert (total - total_before, ok - ok_before) == (REQUESTS, REQUESTS)
