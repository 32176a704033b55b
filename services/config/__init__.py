"""Settings models shared by the services (each service composes them into its own settings)."""

from services.config.control_plane import ControlPlaneSettings, RedisSettings

__all__ = ["ControlPlaneSettings", "RedisSettings"]
