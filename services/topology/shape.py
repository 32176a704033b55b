"""The model's shape as one engine runs it: the one definition every type that carries it embeds.

What the model is (layers, KV heads, head size, KV dtype, vocabulary, context), how its KV is
paged (tokens per block) and how the engine cuts it (PP x TP, the PP layer partition). An
engine's description, its control-plane spec and record, a synthetic engine's claim, vLLM's KV
geometry and a profile's model embed one :class:`ModelShape` (a record the part it carries,
written flat on the wire: ``services.control_plane.wire.RECORD_SHAPE_FIELDS``). Pure code: no
I/O, no third-party imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.topology.ranges import EngineLayout


@dataclass(frozen=True)
class ModelShape:
    """One model's shape and cut; ``0`` or ``""`` for what whoever built it does not know."""

    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    dtype: str = ""
    """The KV cache's dtype (a key of ``services.control_plane.aggregation.DTYPE_BYTES``)."""
    vocab_size: int = 0
    max_model_len: int = 0
    """The context in tokens (prompt + output)."""
    block_size: int = 0
    """Tokens per KV block."""
    pp_size: int = 1
    tp_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    """Layers per PP stage (``None``: :func:`~services.topology.split_layers`'s even split)."""

    @classmethod
    def of(cls, source: object) -> ModelShape:
        """The shape ``source`` holds under these fields' names (an engine's options, a
        profile's model); what it does not hold stays unknown."""
        names = (f.name for f in dataclasses.fields(cls))
        return cls(**{name: getattr(source, name) for name in names if hasattr(source, name)})

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    def layout(self) -> EngineLayout:
        """Every worker's shard under pdserve's cut (:meth:`EngineLayout.uniform`)."""
        return EngineLayout.uniform(
            self.num_layers, self.num_kv_heads, self.pp_size, self.tp_size, self.layer_partition
        )
