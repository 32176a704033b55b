"""``pdserve router``'s flags over its environment settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.cli.router import build_settings
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


def test_the_front_end_is_vllms_with_a_tokenizer_unless_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``auto`` (the default): vLLM's front end for a checkpoint's tokenizer, as ``pdserve up``
    and the chart choose; pdserve's own for the byte-level tokenizer; a flag or the environment
    decides before that."""
    monkeypatch.delenv("PDSERVE_ROUTER_FRONTEND", raising=False)
    assert settings_of("--tokenizer", str(tmp_path)).frontend_in_use == "vllm"
    assert settings_of().frontend_in_use == "pdserve"
    chosen = settings_of("--tokenizer", str(tmp_path), "--frontend", "pdserve")
    assert chosen.frontend_in_use == "pdserve"
    monkeypatch.setenv("PDSERVE_ROUTER_FRONTEND", "pdserve")
    assert settings_of("--tokenizer", str(tmp_path)).frontend_in_use == "pdserve"
    with pytest.raises(ValueError, match="frontend vllm needs tokenizer"):
        settings_of("--frontend", "vllm")
