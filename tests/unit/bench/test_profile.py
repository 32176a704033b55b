"""``pdserve profile``'s pure parts: the non-negative fit, the layout read from engine views,
and the profile built from measured points (loaded by the simulated engine's loader)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from services.bench.profile import (
    ProfileError,
    build_profile,
    fit_nonnegative,
    fleet_of,
    prompt_ids,
    read_model_geometry,
    summary,
)
from services.cli.main import main
from services.control_plane.base import EngineView
from services.control_plane.wire import EngineLoad, EngineRole
from services.engines.sim.profile import ItlPoint, SideLayout, TtftPoint, parse_profile
from services.topology import ModelShape
from tests.unit.router.fakes import view


def _view(engine_id: str, role: EngineRole, *, tp: int = 1, blocks: int = 100) -> EngineView:
    base = view(engine_id, role, load=EngineLoad(kv_blocks_total=blocks), max_model_len=512)
    assert base.record is not None
    shape = dataclasses.replace(base.record.shape, tp_size=tp)
    return dataclasses.replace(base, record=dataclasses.replace(base.record, shape=shape))


def test_the_fit_recovers_exact_coefficients_and_never_goes_negative() -> None:
    rows = [(1.0, t, t * t) for t in (10, 100, 400, 1000)]
    values = [2 + 0.5 * t + 0.001 * t * t for _, t, _ in rows]
    assert fit_nonnegative(rows, values) == pytest.approx([2, 0.5, 0.001], rel=1e-6)
    # Falling with length: an unconstrained fit would give a negative slope; this one
    # keeps every coefficient >= 0 (here: a constant at the mean).
    falling = fit_nonnegative([(1.0, t) for t in (1, 2, 3)], [3.0, 2.0, 1.0])
    assert min(falling) >= 0 and falling == pytest.approx([2.0, 0.0])


def test_the_fleet_is_read_from_the_ready_engines_records_and_loads() -> None:
    fleet = fleet_of(
        [
            _view("p0", EngineRole.PREFILL, tp=2),
            _view("p1", EngineRole.PREFILL, tp=2),
            _view("d0", EngineRole.DECODE, blocks=300),
            _view("d1", EngineRole.DECODE, blocks=200),
        ]
    )
    assert (fleet.model, fleet.engine_kind, fleet.mode) == ("tiny", "reference", "disaggregated")
    assert fleet.prefill == SideLayout(tp_size=2) and fleet.decode == SideLayout()
    assert (fleet.num_blocks, fleet.shape.block_size, fleet.shape.max_model_len) == (200, 4, 512)
    colocated = fleet_of([_view("d0", EngineRole.DECODE)])
    assert colocated.mode == "colocated" and colocated.prefill is None


@pytest.mark.parametrize(
    ("views", "message"),
    [
        ([], "no READY decode engine"),
        (
            [_view("d0", EngineRole.DECODE, tp=1), _view("d1", EngineRole.DECODE, tp=2)],
            "several layouts",
        ),
        ([_view("d0", EngineRole.DECODE, blocks=0)], "KV capacity"),
    ],
)
def test_a_fleet_that_cannot_be_profiled_is_refused(views: list[EngineView], message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        fleet_of(views)


def test_the_built_profile_loads_with_its_layout_points_and_fitted_timing() -> None:
    fleet = fleet_of([_view("p0", EngineRole.PREFILL), _view("d0", EngineRole.DECODE)])
    ttft = [TtftPoint(input_tokens=t, ms=5 + 0.1 * t) for t in (16, 64, 256)]
    itl = [
        ItlPoint(batch=b, context_tokens=c, ms=3 + 0.5 * b + 0.001 * b * c)
        for b in (1, 4)
        for c in (40, 264)
    ]
    profile = build_profile(
        name="measured",
        fleet=fleet,
        geometry=ModelShape(head_size=64, vocab_size=384, dtype="float32"),
        ttft=ttft,
        itl=itl,
        router_url="http://router:8000",
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    again = parse_profile(json.loads(profile.model_dump_json(exclude_none=True)))
    assert again == profile
    assert profile.format_version == 2 and profile.kv_transfer is None
    assert profile.layout is not None and profile.layout.mode == "disaggregated"
    assert profile.prefill_ms(100) == pytest.approx(15)
    assert profile.decode_step_ms(4, 4 * 264) == pytest.approx(3 + 2 + 0.001 * 4 * 264)
    assert profile.measured is not None and profile.measured.ttft == tuple(ttft)
    assert "16 -> 6.6" in profile.source.figures


def test_the_decode_fit_uses_the_batch_that_decoded_in_the_window() -> None:
    # Streams started 32 at a time decoded 13.1 at a time: the fit is of the 13.1.
    fleet = fleet_of([_view("d0", EngineRole.DECODE)])
    itl = [
        ItlPoint(
            batch=b,
            context_tokens=c,
            ms=3 + 0.5 * (b * 0.4 + 0.3) + 0.001 * (b * 0.4 + 0.3) * c,
            effective_batch=b * 0.4 + 0.3,
            output_tokens=64,
            window_gaps=20,
        )
        for b in (1, 8, 32)
        for c in (40, 264)
    ]
    profile = build_profile(
        name="measured",
        fleet=fleet,
        geometry=ModelShape(head_size=64, vocab_size=384, dtype="float32"),
        ttft=[TtftPoint(input_tokens=t, ms=5 + 0.1 * t) for t in (16, 64, 256)],
        itl=itl,
        router_url="http://router:8000",
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    assert (profile.decode.base_ms, profile.decode.per_sequence_ms) == pytest.approx((3, 0.5))
    assert profile.decode.per_context_token_ms == pytest.approx(0.001)
    assert profile.measured is not None and profile.measured.itl == tuple(itl)
    assert "(13.1, 40)" in profile.source.figures
    assert "batch 13.1" in summary(profile) and "64 tokens a stream" in summary(profile)


def test_model_geometry_comes_from_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000})
    )
    assert read_model_geometry(tmp_path) == ModelShape(
        head_size=64, vocab_size=1000, dtype="bfloat16"
    )
    with pytest.raises(ProfileError, match="KV geometry"):
        read_model_geometry(tmp_path / "missing.json")


def test_prompts_are_distinct_from_their_first_token_and_within_the_vocabulary() -> None:
    prompts = [prompt_ids(32, salt, 384) for salt in range(50)]
    assert len({prompt[0] for prompt in prompts}) == 50
    assert all(3 <= token < 384 for prompt in prompts for token in prompt)


def test_the_command_refuses_a_missing_model_config_and_a_bad_name_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["profile", "--router", "http://127.0.0.1:1", "--out", str(tmp_path / "p.json")]
    assert main([*common, "--model-config", str(tmp_path / "nowhere")]) == 2
    assert "KV geometry" in capsys.readouterr().err
    assert main([*common, "--model-config", str(tmp_path), "--name", "../x"]) == 2
    assert "a profile name is" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
