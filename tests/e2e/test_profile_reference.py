"""``pdserve profile`` against the shared reference PD stack (two prefill engines of PP=2 and
one decode engine of the tiny model, tests/e2e/conftest.py): the file it writes is a profile the
simulated engine's loader reads, of the layout and model it measured, and TTFT grows with the
prompt."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from services.engines.sim.profile import SideLayout, check_layout, check_model, load_profile
from services.serving.ready import pdserve_argv
from tests.e2e.conftest import MODEL, SHARED_REFERENCE
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(SHARED_REFERENCE)]

INPUT_LENGTHS = (8, 128, 448)
"""The tiny model's context is 512 tokens."""
PROFILE_TIMEOUT_S = 300.0


def test_profile_of_the_reference_pd_stack_loads_and_follows_its_measurements(
    reference_pd: UpSystem, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tiny-reference.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    endpoints = reference_pd.endpoints
    argv = pdserve_argv(
        "profile",
        "--router", reference_pd.url,
        "--redis", endpoints["redis"],
        "--namespace", endpoints["namespace"],
        "--model-config", str(tiny_model_dir),
        "--served-model", MODEL,  # (the stack serves a second model beside it)
        "--out", str(out),
        "--input-lengths", ",".join(map(str, INPUT_LENGTHS)),
        "--batches", "1,4",
        "--contexts", "32,256",
        "--output-tokens", "16",
        "--repeats", "3",
    )  # fmt: skip
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=PROFILE_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)  # the figures, for the record (-s)

    profile = load_profile(str(out))
    assert profile.name == "tiny-reference"
    assert profile.model.name == MODEL and profile.model.max_model_len == 512
    assert (profile.model.head_size, profile.model.vocab_size) == (64, 384)
    assert profile.layout is not None
    assert (profile.layout.engine_kind, profile.layout.mode) == ("reference", "disaggregated")
    assert profile.layout.sides() == {"prefill": SideLayout(pp_size=2), "decode": SideLayout()}
    assert profile.kv_cache.num_blocks > 0 and profile.kv_cache.block_size == 16
    # The checks the planner and the sim engine make accept it for what it measured, only.
    check_model(profile, [MODEL])
    check_layout(profile, SideLayout(pp_size=2), "prefill")
    with pytest.raises(ValueError, match="PP=1"):
        check_layout(profile, SideLayout(), "prefill")
    with pytest.raises(ValueError, match="tiny-model"):
        check_model(profile, ["another-model"])

    assert profile.measured is not None
    ttft = profile.measured.ttft
    assert [point.input_tokens for point in ttft] == list(INPUT_LENGTHS)
    # Physics: a longer prompt takes longer to prefill (medians of three, far apart).
    assert ttft[0].ms < ttft[-1].ms, ttft
    points = profile.measured.itl
    assert [point.batch for point in points] == [1, 4, 1, 4]
    for point, prompt in zip(points, (32, 32, 256, 256), strict=True):
        # The mean context where every stream decoded: the prompt and part of the output.
        assert prompt < point.context_tokens <= prompt + (point.output_tokens or 16), point
    assert all(point.ms > 0 for point in profile.measured.itl)
    # The fitted prefill follows the measured growth (non-negative terms: monotone).
    assert profile.prefill_ms(INPUT_LENGTHS[-1]) > profile.prefill_ms(INPUT_LENGTHS[0])
    assert "TTFT" in done.stdout and f"wrote {out}" in done.stdout
