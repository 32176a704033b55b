"""How a :class:`~services.engines.reference.backend.ReferenceBackend` is built and run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.engines.errors import ModelConfigError
from services.engines.reference.config import ModelConfig, ModelDtype
from services.kv_transfer.nixl_agent import NixlConfig
from services.topology import EngineLayout
from services.topology.errors import LayoutError


@dataclass(frozen=True)
class ReferenceEngineOptions:
    """Options of one reference engine (one PP x TP grid of rank processes).

    Validated by :meth:`validate` (called by the backend's constructor): a bad value is a
    :class:`ModelConfigError` naming the field, before any process starts.
    """

    model_dir: Path
    """A local HF checkpoint folder (``config.json``, safetensors, tokenizer)."""
    model_name: str | None = None
    """The served model name (and the compatibility hash's model field); the folder name by
    default, so two engines over the same checkpoint are compatible."""
    pp_size: int = 1
    tp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    """Layers per PP stage (vLLM's ``VLLM_PP_LAYER_PARTITION``), e.g. ``(3, 2, 2)``; an even
    split (first stages get the extra layer) when ``None``."""
    num_kv_blocks: int = 256
    """KV blocks per rank (block ids are engine-wide: every rank has the same count)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_batch_tokens: int = 512
    """Most new tokens in one forward step (decode tokens first, then prefill chunks)."""
    max_running: int = 32
    """Most requests admitted at once (running, pulling KV or holding it for a consumer
    count; held prefills are not counted: they no longer compute)."""
    max_queue: int = 256
    """Most requests waiting for admission; beyond it ``EngineOverloaded``."""
    kv_lease_s: float = 30.0
    """How long a prefill engine holds a request's KV for its consumer."""
    kv_pull_timeout_s: float = 30.0
    """A pull not finished after this long fails with reason ``timeout``."""
    prefix_caching: bool = True
    """Reuse the KV of full prompt blocks across requests (``usage.cached_tokens``); see
    :mod:`~services.engines.reference.prefix_cache`."""
    kv_events: bool = True
    """Publish the prefix cache's KV events (:mod:`services.kv_events`, vLLM's wire protocol)
    on two ephemeral ports of every interface, named in the engine's record; needs
    ``prefix_caching`` (without it there are no events and no endpoints)."""
    producer_connect_wait_s: float = 5.0
    """How long a decode rank waits for its pre-warm (PeerSync) to reach a producer that the
    control plane already shows READY, before failing the pull ``producer_unavailable``."""
    dtype: ModelDtype = "float32"
    """Weights, activations and KV-cache dtype."""
    start_timeout_s: float = 180.0
    """Every rank must be up (model loaded, handshake published) within this."""
    stop_timeout_s: float = 20.0
    """A rank that has not exited this long after being asked is killed."""
    metrics_interval_s: float = 1.0
    """How often each rank relays its KV-transfer metrics to the host process."""
    start_method: Literal["fork", "spawn"] = "spawn"
    """How the rank processes start. ``spawn`` (the default) imports torch, NIXL and the rank's
    modules afresh in each (about 3.5 s of CPU per rank); ``fork`` copies the host, which has
    them imported already. pdserve's engine host asks for ``fork`` (``pdserve prefill|decode
    --start-method``): the backend then keeps the host's own torch work (sampling) to one
    thread, so no OpenMP pool exists for a rank to inherit broken (a rank forked after its
    parent ran a parallel torch op can hang in its first one). A process that may already have
    run one (a test process that made a model) must not ask for ``fork``."""
    nixl: NixlConfig = field(default_factory=NixlConfig)

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    def served_model_name(self) -> str:
        return self.model_name or Path(self.model_dir).resolve().name

    def validate(self, config: ModelConfig) -> EngineLayout:
        """Check every field against the model; returns the engine's layout."""
        positive = {
            "pp_size": self.pp_size,
            "tp_size": self.tp_size,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_batch_tokens": self.max_batch_tokens,
            "max_running": self.max_running,
            "max_queue": self.max_queue,
        }
        for name, value in positive.items():
            if value < 1:
                raise ModelConfigError(f"{name} must be >= 1, got {value}")
        for name, seconds in {
            "kv_lease_s": self.kv_lease_s,
            "kv_pull_timeout_s": self.kv_pull_timeout_s,
            "producer_connect_wait_s": self.producer_connect_wait_s,
            "start_timeout_s": self.start_timeout_s,
            "stop_timeout_s": self.stop_timeout_s,
            "metrics_interval_s": self.metrics_interval_s,
        }.items():
            if not seconds > 0:
                raise ModelConfigError(f"{name} must be > 0, got {seconds}")
        try:
            return EngineLayout.uniform(
                config.num_hidden_layers,
                config.num_key_value_heads,
                self.pp_size,
                self.tp_size,
                self.layer_partition,
            )
        except LayoutError as exc:
            raise ModelConfigError(f"cannot lay the model out as PP x TP: {exc}") from exc
