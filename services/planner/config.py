"""Settings of ``pdserve planner`` (environment ``PDSERVE_PLANNER_...``, flags on top)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PredictorName = Literal["constant", "ema"]
RouterDiscovery = Literal["url", "dns"]

LAYOUT_PATTERN = r"^[1-9][0-9]*x[1-9][0-9]*$"


class PlannerSettings(BaseSettings):
    """What the planner reads, the SLOs it sizes for, its pools' bounds and what it serves."""

    model_config = SettingsConfigDict(env_prefix="PDSERVE_PLANNER_", extra="forbid")

    router_url: str = "http://127.0.0.1:8000"
    """The router whose ``/metrics`` the planner reads (``<router_url>/metrics``)."""
    router_discovery: RouterDiscovery = "url"
    """``url``: read ``<router_url>/metrics`` (one router). ``dns``: each interval, resolve the
    URL's host to every address it has (a Kubernetes headless Service: every router pod) and
    read each one's ``/metrics`` at the URL's port, their figures added up (``fleet.py``)."""
    router_metrics_ports: list[int] = Field(default_factory=list)
    """With ``dns``: the ports read on every router address, each one router process (a router
    with ``--workers N`` serves each worker's ``/metrics`` on a port of its own); empty: the
    URL's port."""
    profile: str = "llama-3.1-8b-h100"
    """The engines' profile: a shipped name or a JSON file (the simulated engine's format)."""
    prefill_layout: str = Field(default="1x1", pattern=LAYOUT_PATTERN)
    """The prefill engines' ``PPxTP`` (``1x2``: one stage of two TP ranks); a profile measured
    on another layout is refused at start."""
    decode_layout: str = Field(default="1x1", pattern=LAYOUT_PATTERN)
    """The decode engines' ``PPxTP`` (a colocated profile's engine is checked against both)."""
    api_key: SecretStr | None = None
    """The router's API key, for its ``/v1/models`` (the served model the profile must be of);
    ``/metrics`` needs none."""
    ttft_ms: float = Field(default=500.0, gt=0)
    """Time-to-first-token SLO the prefill pool is sized for (mean)."""
    itl_ms: float = Field(default=50.0, gt=0)
    """Inter-token latency SLO the decode pool is sized for (mean)."""
    interval_s: float = Field(default=30.0, gt=0)
    """Seconds between two decisions (and two reads of the router's figures)."""
    predictor: PredictorName = "constant"
    """How the next interval's load follows from the last ones: ``constant`` (the last
    interval's) or ``ema`` (an exponential moving average)."""
    ema_alpha: float = Field(default=0.5, gt=0, le=1)
    """The weight of the newest interval in the ``ema`` predictor."""
    input_tokens: float = Field(default=1024.0, gt=0)
    """Mean prompt length in tokens until the router has measured it (its
    ``pdserve_router_request_prompt_tokens``; a router without it: always)."""
    output_tokens: float = Field(default=256.0, gt=0)
    """Mean generated length in tokens until the router has measured it (as
    ``input_tokens``)."""
    prefill_min: int = Field(default=1, ge=1)
    """Fewest prefill engines (never zero: an outage never empties a pool)."""
    prefill_max: int = Field(default=8, ge=1)
    """Most prefill engines."""
    decode_min: int = Field(default=1, ge=1)
    """Fewest decode engines."""
    decode_max: int = Field(default=8, ge=1)
    """Most decode engines."""
    stabilization_intervals: int = Field(default=5, ge=1)
    """A pool goes down only after its need was lower for this many intervals (up at once)."""
    correction_min: float = Field(default=0.5, gt=0)
    """Lowest observed/expected ratio applied to the SLOs."""
    correction_max: float = Field(default=3.0, gt=0)
    """Highest observed/expected ratio applied to the SLOs."""
    kv_usage_limit: float = Field(default=0.9, gt=0, le=1)
    """The decode pool's KV usage (``1 - free / total`` blocks over its engines, as the router
    relays them) above which it needs one engine more than it has: past it vLLM preempts
    running sequences. 1 turns the rule off."""
    cached_tokens: bool = True
    """Size the prefill pool for the part of each prompt that is not cached: the router's
    ``pdserve_router_cached_tokens{pool="prefill"}`` (the tokens its placements found in the
    prefill engines' prefix caches). Off: as if every prompt token were computed (a
    comparison run, ``pdserve bench goodput --trace``)."""
    prefill_queue_limit: float | None = Field(default=None, ge=0)
    """Requests waiting per prefill engine above which that pool needs one engine more than it
    has; ``None``: what the TTFT SLO allows, ``ttft_ms`` over one prefill of the mean prompt
    in the profile (at least 1)."""
    scrape_timeout_s: float = Field(default=5.0, gt=0)
    """Bound of one read of the router's ``/metrics``."""
    metrics_host: str = "127.0.0.1"
    """Address of the planner's own ``/metrics``."""
    metrics_port: int = Field(default=9400, ge=0, le=65535)
    """Port of the planner's own ``/metrics`` (0: a free one, announced on its ready line)."""

    @field_validator("router_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"router_url must be an http:// or https:// URL, got {value!r}")
        return value.rstrip("/")

    @field_validator("router_metrics_ports")
    @classmethod
    def _ports(cls, value: list[int]) -> list[int]:
        if any(not 1 <= port <= 65535 for port in value):
            raise ValueError(f"router_metrics_ports must be ports (1..65535), got {value}")
        return value

    @model_validator(mode="after")
    def _check(self) -> PlannerSettings:
        if self.prefill_min > self.prefill_max:
            raise ValueError("prefill_min must be <= prefill_max")
        if self.decode_min > self.decode_max:
            raise ValueError("decode_min must be <= decode_max")
        if self.router_metrics_ports and self.router_discovery != "dns":
            raise ValueError("router_metrics_ports needs router_discovery='dns'")
        if self.correction_min > self.correction_max:
            raise ValueError("correction_min must be <= correction_max")
        return self
