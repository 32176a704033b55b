"""Settings of the command-line tools: environment (``PDSERVE_...``) first, flags on top."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import TypeVar

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.config import ControlPlaneSettings

ModelT = TypeVar("ModelT", bound=BaseModel)


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


def flag_values(
    args: argparse.Namespace, flags: Iterable[str] | Mapping[str, str]
) -> dict[str, object]:
    """The flags given on the command line (those not ``None``), keyed by settings field:
    ``flags`` names them (flag and field alike) or maps each flag's dest to its field."""
    fields = flags if isinstance(flags, Mapping) else {flag: flag for flag in flags}
    values: dict[str, object] = {}
    for flag, field in fields.items():
        value = getattr(args, flag, None)
        if value is not None:
            values[field] = value
    return values


def overlay(settings: ModelT, overrides: Mapping[str, object]) -> ModelT:
    """``settings`` (read from the environment) with ``overrides`` (the flags) on top,
    validated again: the one way a command puts its flags over its settings."""
    return type(settings).model_validate({**settings.model_dump(), **overrides})


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
    control_plane = overlay(cp, update)
    return settings.model_copy(update={"control_plane": control_plane})
