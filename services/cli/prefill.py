"""``pdserve prefill``: host a prefill engine (see :mod:`services.serving.cli` for the flags)."""

from __future__ import annotations

import argparse

from services.cli.settings import ToolSettings
from services.control_plane.wire import EngineRole
from services.serving import cli as serving_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serving_cli.add_arguments(parser)


def run(args: argparse.Namespace, settings: ToolSettings) -> int:
    return serving_cli.run(args, settings, EngineRole.PREFILL)
