"""``pdserve router``'s flags over its environment settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.cli.main import build_parser
from services.cli.router import build_settings, run
from services.cli.settings import resolve
from services.router.config import RouterSettings


def settings_of(*argv: str) -> RouterSettings:
    args = build_parser().parse_args(["router", *argv])
    return build_settings(args, resolve(args))


def test_kv_events_are_followed_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_ROUTER_KV_EVENTS", raising=False)
    assert settings_of().kv_events is True
    assert settings_of("--no-kv-events").kv_events is False
    # Without the flag the environment decides (what `pdserve up --router-arg` leaves alone).
    monkeypatch.setenv("PDSERVE_ROUTER_KV_EVENTS", "false")
    assert settings_of().kv_events is False


def test_the_router_needs_the_checkpoint_its_front_end_reads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No ``--tokenizer``: one message naming it, before anything starts (there is no other
    front end to fall back to); the flags reach the settings."""
    args = build_parser().parse_args(["router"])
    assert run(args, resolve(args)) == 2
    assert "--tokenizer is required" in capsys.readouterr().err
    chosen = settings_of("--tokenizer", str(tmp_path), "--served-model-name", "stub")
    assert (chosen.tokenizer, chosen.served_model_name) == (tmp_path, "stub")
    with pytest.raises(SystemExit):
        settings_of("--frontend", "pdserve")  # the router's own front end is gone


def test_each_model_flag_is_a_served_base_model_with_its_front_end_flags(tmp_path: Path) -> None:
    """``--model DIR[,name=NAME][,frontend-arg=FLAG...]`` (repeatable) after ``--tokenizer``'s
    model; two models of one name are refused."""
    chosen = settings_of(
        "--tokenizer",
        str(tmp_path / "a"),
        "--model",
        f"{tmp_path / 'b'},name=bee,frontend-arg=--max-model-len=64",
    )
    served = chosen.served_models()
    assert [(m.tokenizer, m.name) for m in served] == [
        (tmp_path / "a", "a"),
        (tmp_path / "b", "bee"),
    ]
    assert served[1].frontend_args == ["--max-model-len=64"]
    with pytest.raises(ValidationError, match="two served models have the same name: a"):
        settings_of("--tokenizer", str(tmp_path / "a"), "--model", str(tmp_path / "x" / "a"))
