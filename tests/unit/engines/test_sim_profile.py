"""The simulated engine's profile: the shipped file, its timing model, and refused profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.engines.sim.profile import (
    DEFAULT_PROFILE,
    SideLayout,
    SimProfile,
    SimProfileError,
    check_layout,
    check_model,
    load_profile,
    parse_profile,
    shipped_profiles,
)


def _data() -> dict[str, object]:
    return json.loads(load_profile().model_dump_json())


def _profile(**timing: dict[str, float]) -> SimProfile:
    data = _data()
    data.update(timing)
    return parse_profile(data)


def test_the_shipped_profile_loads_names_its_source_and_follows_its_published_points() -> None:
    assert DEFAULT_PROFILE in shipped_profiles()
    profile = load_profile(DEFAULT_PROFILE)
    assert profile.source.url.startswith("https://docs.nvidia.com/")
    assert "4.63" in profile.source.figures  # ITL at concurrency 1, the decode base
    assert profile.served_model == "sim-llama-3.1-8b-h100"
    # Within 10% of the published ITL at concurrency 1 to 100 (~300 context tokens each).
    for batch, published_ms in ((1, 4.63), (25, 5.19), (50, 5.91), (100, 7.57)):
        modelled = profile.decode_step_ms(batch, batch * 300)
        assert abs(modelled - published_ms) / published_ms < 0.1, (batch, modelled)
    assert abs(profile.prefill_ms(200) - 10.26) / 10.26 < 0.1


def test_prefill_is_linear_plus_quadratic_and_chunks_add_up_to_the_whole_prompt() -> None:
    profile = _profile(
        prefill={"base_ms": 2.0, "per_token_ms": 0.5, "per_token_squared_ms": 0.001},
        decode={"base_ms": 3.0, "per_sequence_ms": 0.25, "per_context_token_ms": 0.01},
    )
    assert profile.prefill_ms(100) == pytest.approx(2.0 + 50 + 10)
    assert profile.prefill_ms(0) == 0.0
    # Two chunks of 50: each pays a fixed cost, the variable parts add up to 100 tokens'.
    first = profile.step_ms(prefill_chunks=[(0, 50)])
    second = profile.step_ms(prefill_chunks=[(50, 50)])
    assert first + second == pytest.approx(profile.prefill_ms(100) + 2.0)
    assert second > first  # the later chunk attends to more context


def test_decode_step_grows_with_batch_and_context_and_a_prefill_chunk_lengthens_it() -> None:
    profile = _profile(
        prefill={"base_ms": 2.0, "per_token_ms": 0.5, "per_token_squared_ms": 0.0},
        decode={"base_ms": 3.0, "per_sequence_ms": 0.25, "per_context_token_ms": 0.01},
    )
    assert profile.decode_step_ms(4, 400) == pytest.approx(3.0 + 1.0 + 4.0)
    assert profile.decode_step_ms(8, 400) > profile.decode_step_ms(4, 400)
    assert profile.decode_step_ms(4, 800) > profile.decode_step_ms(4, 400)
    assert profile.decode_step_ms(0, 0) == 0.0
    mixed = profile.step_ms(prefill_chunks=[(0, 64)], decode_batch=4, decode_context_tokens=400)
    # One forward pass: one fixed cost (the larger), every variable term.
    assert mixed == pytest.approx(3.0 + 1.0 + 4.0 + 0.5 * 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode": {"base_ms": -1, "per_sequence_ms": 0, "per_context_token_ms": 0}}, "decode"),
        ({"kv_cache": {"num_blocks": 0, "block_size": 16}}, "kv_cache.num_blocks"),
        ({"format_version": 3}, "format_version"),
        ({"layout": None}, "layout"),
        (
            {"layout": {"engine_kind": "vllm", "mode": "colocated", "prefill": {}, "decode": {}}},
            "prefill side",
        ),
        ({"surprise": 1}, "surprise"),
        ({"name": "../etc"}, "name"),
    ],
)
def test_bad_profiles_are_refused_naming_the_field(change: dict[str, object], message: str) -> None:
    data = _data()
    data.update(change)
    with pytest.raises(SimProfileError, match=message):
        parse_profile(data)


def test_profiles_are_found_by_name_or_path_and_unknown_names_list_the_choices(
    tmp_path: Path,
) -> None:
    path = tmp_path / "mine.json"
    data = _data()
    data["name"] = "mine"
    path.write_text(json.dumps(data))
    assert load_profile(str(path)).name == "mine"
    with pytest.raises(SimProfileError, match=DEFAULT_PROFILE):
        load_profile("no-such-profile")
    with pytest.raises(SimProfileError, match="no such file"):
        load_profile(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SimProfileError, match="cannot be read"):
        load_profile(str(tmp_path / "broken.json"))


def test_a_kv_transfer_moves_the_prompts_bytes_at_the_links_rate() -> None:
    profile = load_profile()
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16 KV
    assert profile.kv_transfer is not None
    moved_ms = 1000 * 1000 * profile.kv_bytes_per_token / (profile.kv_transfer.gb_per_s * 1e9)
    assert profile.transfer_ms(1000) == pytest.approx(profile.kv_transfer.base_ms + moved_ms)
    assert profile.transfer_ms(0) == 0.0
    data = _data()
    del data["kv_transfer"]
    assert parse_profile(data).transfer_ms(1000) == 0.0  # optional: no transfer time


def test_a_format_1_profile_is_read_without_a_layout_and_passes_every_check() -> None:
    data = _data()
    data["format_version"] = 1
    del data["layout"]
    profile = parse_profile(data)
    assert profile.layout is None
    check_layout(profile, SideLayout(pp_size=4, tp_size=8))


def test_layout_and_model_checks_name_both_sides() -> None:
    data = _data()
    data["layout"] = {
        "engine_kind": "vllm",
        "mode": "disaggregated",
        "prefill": {"pp_size": 1, "tp_size": 2},
        "decode": {"pp_size": 1, "tp_size": 1},
    }
    profile = parse_profile(data)
    check_layout(profile, SideLayout(tp_size=2), "prefill")
    check_layout(profile, SideLayout(tp_size=1))  # either side, for a role-less engine
    with pytest.raises(SimProfileError, match=r"prefill PP=1 x TP=2.*decode engines here: PP=2"):
        check_layout(profile, SideLayout(pp_size=2), "decode")
    check_model(profile, ["meta-llama/Llama-3.1-8B-Instruct"])
    check_model(profile, ["other", profile.served_model])
    with pytest.raises(SimProfileError, match=r"Llama-3.1-8B-Instruct.*router serves tiny"):
        check_model(profile, ["tiny"])
