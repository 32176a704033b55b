"""Loading a shard's weights from a local HF safetensors checkpoint.

A checkpoint is either one ``model.safetensors`` or several files listed by
``model.safetensors.index.json``. Each shard reads only the tensors it owns and, for TP-split
tensors, only its rows or columns (safetensors slices are read lazily from the mmapped file), so
a worker's memory holds its shard and nothing else.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from services.engines.errors import CheckpointError
from services.engines.reference.config import ModelConfig
from services.engines.reference.layers import AllReduce
from services.engines.reference.model import LlamaShard, WeightSource
from services.engines.reference.sharding import ShardSpec

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    directory: str | Path,
    spec: ShardSpec | None = None,
    *,
    all_reduce: AllReduce | None = None,
    dtype: torch.dtype = torch.float32,
) -> LlamaShard:
    """Build the shard ``spec`` (the whole model by default) of the checkpoint in ``directory``
    and load its weights, cast to ``dtype``.

    Raises ``ModelConfigError`` / ``UnsupportedModelError`` for the config,
    :class:`ShardingError` for the cut and :class:`CheckpointError` for the weights.
    """
    config = ModelConfig.from_directory(directory)
    model = LlamaShard(config, spec, all_reduce=all_reduce, dtype=dtype)
    load_weights(model, directory)
    return model


def load_weights(model: LlamaShard, directory: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint in ``directory``.

    Raises :class:`CheckpointError` when a file or tensor is missing, unreadable or of a shape
    other than the config implies.
    """
    sources = model.weight_sources()
    params = dict(model.named_parameters())
    if set(sources) != set(params):
        # A mismatch is a bug in weight_sources, not a bad checkpoint.
        raise AssertionError(f"unmapped parameters: {set(sources) ^ set(params)}")
    tensor_files = checkpoint_index(directory)
    missing = sorted(source.name for source in sources.values() if source.name not in tensor_files)
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise CheckpointError(
            f"{len(missing)} tensors this shard needs are missing from the checkpoint at "
            f"{directory}: {shown}"
        )
    by_file: dict[Path, list[str]] = defaultdict(list)
    for param_name, source in sources.items():
        by_file[tensor_files[source.name]].append(param_name)
    for path, param_names in sorted(by_file.items()):
        with _mapped_errors(path), safe_open(str(path), framework="pt") as handle:
            for param_name in param_names:
                tensor = _read(handle, sources[param_name], path)
                param = params[param_name]
                if tensor.shape != param.shape:
                    raise CheckpointError(
                        f"{sources[param_name].name}: slice of shape {tuple(tensor.shape)} does "
                        f"not fit parameter {param_name} {tuple(param.shape)}"
                    )
                param.data.copy_(tensor.to(param.dtype))
    logger.info(
        "loaded %d tensors for layers %s, TP rank %d/%d from %s",
        len(sources),
        model.geometry.layers,
        model.geometry.tp_rank,
        model.geometry.tp_size,
        directory,
    )


def checkpoint_index(directory: str | Path) -> Mapping[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    root = Path(directory)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read {index_path}: {exc!r}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map is not an object")
        files: dict[str, Path] = {}
        for name, file_name in weight_map.items():
            path = root / str(file_name)
            if not path.is_file():
                raise CheckpointError(f"{index_path} names {file_name}, which is not in {root}")
            files[str(name)] = path
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with _mapped_errors(single), safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {root} (only safetensors checkpoints are supported)"
    )


def _read(handle: Any, source: WeightSource, path: Path) -> torch.Tensor:
    """The shard's part of one tensor, reading only that part from disk.

    ``handle`` is an open ``safe_open`` (untyped upstream, hence ``Any``).
    """
    lazy = handle.get_slice(source.name)
    shape = tuple(lazy.get_shape())
    if shape != source.full_shape:
        raise CheckpointError(
            f"{source.name} in {path.name} has shape {shape}, the config implies "
            f"{source.full_shape}"
        )
    if source.dim is None or source.part is None:
        tensor: torch.Tensor = lazy[:]
    elif source.dim == 0:
        tensor = lazy[source.part.start : source.part.stop]
    else:
        tensor = lazy[:, source.part.start : source.part.stop]
    return tensor


@contextmanager
def _mapped_errors(path: Path) -> Iterator[None]:
    """safetensors and file-system failures as :class:`CheckpointError`."""
    try:
        yield
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
