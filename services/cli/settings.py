"""Settings of the command-line tools: environment (``PDSERVE_...``) first, flags on top."""

from __future__ import annotations

import argparse

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.config import ControlPlaneSettings


class ToolSettings(BaseSettings):
    """What ``pdserve status``, ``bench`` and ``up`` read from the environment.

    Nested fields use ``__``: ``PDSERVE_CONTROL_PLANE__REDIS__URL``,
    ``PDSERVE_CONTROL_PLANE__REDIS__PASSWORD``, ``PDSERVE_CONTROL_PLANE__NAMESPACE``.
    """

    model_config = SettingsConfigDict(env_prefix="PDSERVE_", env_nested_delimiter="__")

    control_plane: ControlPlaneSettings = Field(default_factory=ControlPlaneSettings)
    """Redis and lease settings."""
    log_level: str = "WARNING"
    """Python logging level of the tool."""


def add_control_plane_flags(parser: argparse.ArgumentParser) -> None:
    """``--redis``, ``--namespace``: override the environment for one command."""
    parser.add_argument("--redis", metavar="URL", help="control-plane Redis URL")
    parser.add_argument("--namespace", help="control-plane namespace (key prefix)")


def resolve(args: argparse.Namespace) -> ToolSettings:
    """Environment settings with the command's flags applied on top."""
    settings = ToolSettings()
    cp = settings.control_plane
    redis = cp.redis
    if getattr(args, "redis", None):
        redis = redis.model_copy(update={"url": args.redis})
    password = getattr(args, "redis_password", None)
    if password:
        redis = redis.model_copy(update={"password": SecretStr(password)})
    update: dict[str, object] = {"redis": redis}
    if getattr(args, "namespace", None):
        update["namespace"] = args.namespace
    control_plane = ControlPlaneSettings.model_validate({**cp.model_dump(), **update})
    return settings.model_copy(update={"control_plane": control_plane})
