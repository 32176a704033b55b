"""``ModelShape``: built by name from what holds its fields, and cut as ``EngineLayout.uniform``."""

from __future__ import annotations

from dataclasses import dataclass

from services.topology import EngineLayout, ModelShape


@dataclass(frozen=True)
class _Options:
    num_layers: int = 7
    num_kv_heads: int = 2
    pp_size: int = 2
    layer_partition: tuple[int, ...] | None = (3, 4)
    token_delay_s: float = 0.5


def test_of_copies_the_fields_it_finds_and_leaves_the_rest_unknown() -> None:
    shape = ModelShape.of(_Options())
    assert shape == ModelShape(num_layers=7, num_kv_heads=2, pp_size=2, layer_partition=(3, 4))
    assert (shape.head_size, shape.dtype, shape.tp_size, shape.world_size) == (0, "", 1, 2)


def test_layout_is_the_uniform_cut_with_the_partition() -> None:
    shape = ModelShape(num_layers=7, num_kv_heads=2, pp_size=2, tp_size=2, layer_partition=(3, 4))
    assert shape.layout() == EngineLayout.uniform(7, 2, 2, 2, [3, 4])
    assert shape.layout().stage_layers(1).start == 3
