"""``pdserve up --engine sim``: no model is made, and every engine gets the engine kind and
the profile."""

from __future__ import annotations

from pathlib import Path

from services.cli.main import build_parser
from services.cli.up_children import engine_children, model_dir
from services.cli.up_models import up_models


def test_sim_engines_get_no_model_and_the_profile(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["up", "--engine", "sim", "--sim-profile", "llama-3.1-8b-h100", "--decode-replicas", "2"]
    )
    assert model_dir(args) is None
    children = engine_children(args, up_models(args, None), [], tmp_path, {})
    assert [c.name for c in children] == ["prefill-0", "decode-0", "decode-1"]
    for child in children:
        assert "--model" not in child.argv
        engine = child.argv.index("--engine")
        assert child.argv[engine + 1] == "sim"
        profile = child.argv.index("--sim-profile")
        assert child.argv[profile + 1] == "llama-3.1-8b-h100"
