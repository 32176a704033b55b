"""``pdserve router``'s flags over its environment settings."""

from __future__ import annotations

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
